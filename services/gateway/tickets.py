"""What one admission decision hands out and reads: ``Ticket`` (an admitted request's places, owned by the
request and given back by ``release``), ``AdmissionRefused`` (a refusal and its status), and ``Quota`` (what
admission reads of a tenant's quotas). ``services.gateway.admission.Admission`` makes the tickets and takes
their places back; callers hold them until their answer ends."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from services.gateway.state.base import Lease

if TYPE_CHECKING:
    from services.gateway.admission import Admission


class AdmissionRefused(Exception):
    """The request was not admitted: ``status`` 429 (its tenant's queue is full, or the tenant is over a
    quota) or 503 (it waited ``admission_wait_s`` in vain); ``retry_after_s`` goes into ``Retry-After``."""

    def __init__(self, status: int, message: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.status, self.message, self.retry_after_s = status, message, retry_after_s


ANONYMOUS = "anonymous"  # services.gateway.tenants.ANONYMOUS (this module imports no service module)


class Quota(Protocol):
    """What admission reads of a tenant's quotas (``services.gateway.tenants.Tenant``; None: no limit)."""

    max_in_flight: int | None
    max_queue: int | None
    images_per_minute: int | None

    @property
    def share(self) -> float: ...


@dataclass(frozen=True)
class NoQuota:
    """A tenant without quotas (a gateway without a keys file)."""

    max_in_flight: int | None = None
    max_queue: int | None = None
    images_per_minute: int | None = None
    share: float = 1.0


NO_QUOTA = NoQuota()


@dataclass(eq=False)
class Ticket:
    """One admitted request's places: an LM place, an encoder place if it encodes remotely, one of its
    tenant's ``max_in_flight`` (``lease``, owned by the ticket and given back by ``release``); ``items``: the
    media items charged against its tenant's ``images_per_minute``."""

    admission: Admission
    encoder: bool
    tenant: str = ANONYMOUS
    released: bool = False
    items: int = 0
    lease: Lease | None = None

    def count_items(self, items: int) -> None:
        """The request carries ``items`` media items now: a speech upload, one item at admission, becomes one
        item per window its encoder cut (the orchestrator calls this once an attempt's items have their
        sources). Those beyond what was charged are charged now, never refused (the request is admitted and
        they are encoded); a retry that cuts the same windows again charges nothing more."""
        if items > self.items:
            self.admission._charge(self.tenant, items - self.items)
            self.items = items

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.admission._release(self)

    def drop_encoder(self) -> None:
        """The request will not encode on an encoder after all (placement chose the LM, or no
        encoder is healthy): its encoder slot goes back now."""
        if self.encoder and not self.released:
            self.encoder = False
            self.admission._release_encoder(self)
