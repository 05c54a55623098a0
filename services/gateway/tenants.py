"""Who a client of the gateway is: its tenant, named by the API key its request carries.

One ``Tenants`` per gateway: ``services.cli`` (or ``server.serve``) makes it from the config, the
REST middleware and the gRPC interceptor (``services.gateway.auth``) ask it on the event loop, and
``server.serve`` calls ``reload`` on SIGHUP. Where keys come from:

- ``--api-key`` (several, space-separated), else the ``VLLM_API_KEY`` environment variable, as
  ``vllm serve`` reads them; these are the tenant ``default``.
- ``--api-keys-file``: one tenant per key, one JSON object per line::

      {"tenant": "acme", "key": "sk-acme-2024"}
      {"tenant": "acme", "key": "sk-acme-2025"}
      {"tenant": "lab", "key": "sk-lab-1"}

  A tenant may have several keys (one per line: a new key is added, clients move, the old line is
  removed, each step a reload). Blank lines and lines starting with ``#`` are skipped. A tenant's
  name is letters, digits and ``._-`` (at most 64); a key is printable ASCII (what a header or a
  gRPC metadata value can carry), with no space at either end.

  A line may also set the tenant's quotas (``QUOTAS``; each unset field: no limit for this tenant
  beyond the deployment's), read into ``Tenant``::

      {"tenant": "lab", "key": "sk-lab-1", "max_in_flight": 4, "max_queue": 2, "body_mib": 256,
       "images_per_minute": 600, "max_background": 8, "weight": 2}

  ``max_in_flight``: its admitted requests in flight at once (``services.gateway.admission``);
  ``max_queue``: its admission queue's length (default ``--admission-queue``); ``body_mib``: the
  body budget it may hold at once (``services.gateway.intake``); ``images_per_minute``: media items
  (images, audio clips, videos, as counted against ``--max-images``, and a speech upload's windows)
  it may have admitted per minute, a token bucket that holds a minute's worth
  (``services.gateway.admission``); ``max_background``: background Responses it holds at once, in
  place of its share of them (``services.gateway.background``); ``weight`` (default 1): its share
  beside other tenants, of freed admission places, of the body budget and of the background places
  (a tenant of weight 2 gets twice the share of one of weight 1). A tenant over a quota is answered 429 with
  ``Retry-After``. Every line of one tenant carries the same quotas (the same fields, the same
  values), or the file is refused naming the line that differs. Any other field is refused, so that
  a file written for a later gateway is never half understood.

No key from any source: the gateway is open, and every request is the tenant ``anonymous`` (it
stays open: a reload cannot turn keys on, and a keys file without keys is refused, so that an
emptied file never opens a gateway). ``reload`` reads the file again and swaps the whole key table
and the quotas at once; a file that does not load leaves both as they were (and says why in the
log). ``quota(name)`` is how the admission, the intake and background work read a tenant's quotas,
at every decision, so a reload holds from the next decision on.

Keys are held only as SHA-256 digests and compared in constant time (``hmac.compare_digest``),
against every key every time, as vLLM's middleware does. No key appears in a log line, an error
message or a repr; tenant names may.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import math
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace

logger = logging.getLogger(__name__)

ANONYMOUS = "anonymous"
"""The tenant of every request to a gateway without keys, and of an unguarded route's request that
carries no key it knows."""
DEFAULT = "default"
"""The tenant of the keys of ``--api-key`` / ``VLLM_API_KEY``."""
TENANT_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")
QUOTAS: dict[str, tuple[type, float]] = {
    # field: (type, least value)
    "max_in_flight": (int, 1),
    "max_queue": (int, 0),
    "body_mib": (float, 0),  # more than this
    "images_per_minute": (int, 1),
    "max_background": (int, 0),
    "weight": (float, 0),  # more than this
}
"""A tenant's optional quotas in the keys file, ``Tenant``'s fields of the same names."""
FILE_FIELDS = ("tenant", "key", *QUOTAS)
"""The fields of a keys file's line (``Tenant``'s fields, and its key)."""


@dataclass(frozen=True)
class Tenant:
    """One client of the gateway, as the rest of a request's path sees it (the key stays here), with
    its quotas from the keys file (None: no limit for this tenant beyond the deployment's)."""

    name: str
    max_in_flight: int | None = None
    """Admitted requests in flight at once."""
    max_queue: int | None = None
    """Requests waiting for admission at once (None: ``--admission-queue``)."""
    body_mib: float | None = None
    """Body budget held at once, in MiB."""
    images_per_minute: int | None = None
    """Media items admitted per minute (a token bucket of this many, refilled at this rate)."""
    max_background: int | None = None
    """Background Responses requests held at once."""
    weight: float | None = None
    """Its share of admission and of the body budget beside other tenants (None: 1): freed places go to the
    tenant with the fewest in flight per unit of weight, and a tenant's part of the budget is its weight's
    part of the active tenants' weights."""
    part: float = field(default=1.0, compare=False)
    """Its weight's part of the weights of every tenant the keys name (``Tenants`` derives it; not a field of
    the keys file, and not compared): the part of the background places it may hold
    (``services.gateway.background``). 1 for the one tenant of a gateway without keys or with ``--api-key``
    alone; 0 for a name the keys do not know."""

    @property
    def share(self) -> float:
        """Its weight (1 when unset)."""
        return 1.0 if self.weight is None else self.weight

    @property
    def body_bytes(self) -> int | None:
        return None if self.body_mib is None else int(self.body_mib * (1 << 20))


def read_quotas(entry: dict, where: str) -> dict:
    """The quota fields of a keys file's line, checked (``QUOTAS``). Raises ValueError naming ``where``."""
    quotas = {}
    for name, (kind, least) in QUOTAS.items():
        if name not in entry:
            continue
        value = entry[name]
        ok = isinstance(value, (int, float) if kind is float else int) and not isinstance(value, bool)
        if ok and kind is float:
            ok = math.isfinite(value) and value > least
        elif ok:
            ok = value >= least
        if not ok:
            what = f"a number above {least:g}" if kind is float else f"an integer of at least {least:g}"
            raise ValueError(f"{where}: \"{name}\" must be {what}")
        quotas[name] = kind(value)
    return quotas


ANONYMOUS_TENANT = Tenant(ANONYMOUS)


def key_digest(key: str) -> bytes:
    """What is kept of a key and compared: its SHA-256 (as vLLM's middleware keeps its tokens).
    ``surrogatepass``: a header or argument with undecodable bytes is digested, never an error."""
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


def bearer(value: str | None) -> str | None:
    """The key in an ``Authorization`` value, by vLLM's rule: ``<scheme> <key>``, the scheme
    ``bearer`` in any case, the key everything after the first space. None: no bearer key."""
    if not value:
        return None
    scheme, _, key = value.partition(" ")
    return key if scheme.lower() == "bearer" else None


def read_keys_file(path: str, taken: Iterable[bytes] = ()) -> list[tuple[bytes, Tenant]]:
    """The (key digest, tenant) pairs of the keys file at ``path``. ``taken``: digests already in
    use (``--api-key``'s), which no line may repeat. Raises ValueError (which line, and why; never
    the key) or OSError."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except UnicodeDecodeError:
        raise ValueError(f"{path}: not UTF-8 text") from None
    seen = {d: "--api-key" for d in taken}
    table: list[tuple[bytes, Tenant]] = []
    first: dict[str, tuple[int, Tenant]] = {}  # per tenant: its first line, and what it set
    for n, line in enumerate(lines, 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        where = f"{path}, line {n}"
        try:
            entry = json.loads(line)
        except ValueError as e:  # its message names a position, never the text
            raise ValueError(f"{where}: not a JSON object ({e.msg} at column {e.colno})") from None
        if not isinstance(entry, dict):
            raise ValueError(f"{where}: not a JSON object")
        unknown = sorted(set(entry) - set(FILE_FIELDS))
        if unknown:
            raise ValueError(f"{where}: unknown field(s) {unknown}; allowed: {list(FILE_FIELDS)}")
        name, key = entry.get("tenant"), entry.get("key")
        if not isinstance(name, str) or not TENANT_NAME.fullmatch(name) or name == ANONYMOUS:
            raise ValueError(f"{where}: \"tenant\" must match {TENANT_NAME.pattern} (and not be {ANONYMOUS!r})")
        if not isinstance(key, str) or not key or not key.isascii() or not key.isprintable() or key != key.strip():
            raise ValueError(f"{where}: \"key\" must be printable ASCII with no space at either end")
        digest = key_digest(key)
        if digest in seen:
            raise ValueError(f"{where}: the same key as {seen[digest]} (one key names one tenant)")
        tenant = Tenant(name, **read_quotas(entry, where))
        if name in first and first[name][1] != tenant:
            raise ValueError(f"{where}: tenant {name}'s quotas differ from its line {first[name][0]} (every line "
                             "of a tenant sets the same quota fields to the same values)")
        first.setdefault(name, (n, tenant))
        seen[digest] = f"line {n}"
        table.append((digest, tenant))
    if not table:
        raise ValueError(f"{path}: no keys (a keys file names at least one tenant; for an open gateway "
                         "leave --api-keys-file unset)")
    return table


class Tenants:
    """The gateway's keys and whose they are (see the module docstring)."""

    def __init__(self, keys: Iterable[str] = (), keys_file: str = "") -> None:
        """``keys``: the tenant ``default``'s (empty strings are no keys); ``keys_file``: the
        ``--api-keys-file``. Raises ValueError or OSError for a file that does not load."""
        self._fixed = [(key_digest(k), Tenant(DEFAULT)) for k in dict.fromkeys(keys) if k]
        self.keys_file = keys_file
        self.required = bool(self._fixed or keys_file)
        """Whether a guarded route needs a key; fixed at start."""
        self._table = self._load()
        self._quotas = self._by_name(self._table)

    @staticmethod
    def _by_name(table: list[tuple[bytes, Tenant]]) -> dict[str, Tenant]:
        return {t.name: t for _, t in table}

    def quota(self, name: str) -> Tenant:
        """The tenant ``name`` with its quotas as loaded now (a name the keys do not know, ``anonymous``
        or one a reload removed: no quotas, and no part of the background places while keys are
        required). Called at every admission, body and background decision."""
        return self._quotas.get(name) or Tenant(name, part=0.0 if self.required else 1.0)

    @classmethod
    def from_config(cls, cfg, environ: Mapping[str, str] = os.environ) -> Tenants:
        """``vllm serve``'s rule: ``--api-key``'s keys, or else ``VLLM_API_KEY``'s (``cfg``: a
        ``GatewayConfig``); and ``--api-keys-file``'s."""
        return cls(cfg.api_key or [environ.get("VLLM_API_KEY") or ""], cfg.api_keys_file)

    def _load(self) -> list[tuple[bytes, Tenant]]:
        """The key table, each tenant with its ``part`` of all the tenants' weights."""
        extra = read_keys_file(self.keys_file, [d for d, _ in self._fixed]) if self.keys_file else []
        table = self._fixed + extra
        total = sum(t.share for t in self._by_name(table).values())
        return [(d, replace(t, part=t.share / total)) for d, t in table]

    def identify(self, authorization: str | None) -> Tenant | None:
        """The tenant whose key ``authorization`` (an ``Authorization`` header's value, or the
        ``authorization`` metadata of a gRPC call) carries; ``anonymous`` for every request when
        no key is required. None: no key, or one the gateway does not know."""
        if not self.required:
            return ANONYMOUS_TENANT
        key = bearer(authorization)
        if key is None:
            return None
        got, found = key_digest(key), None
        for digest, tenant in self._table:  # every key, whether or not one matched already
            if hmac.compare_digest(got, digest) and found is None:
                found = tenant
        return found

    def reload(self) -> bool:
        """Reads ``--api-keys-file`` again (``server.serve``'s SIGHUP handler); ``--api-key``'s keys
        stay. A file that does not load leaves the keys as they were. True: the new keys hold."""
        if not self.keys_file:
            logger.info("API keys: no --api-keys-file to read again")
            return False
        try:
            table = self._load()
        except (OSError, ValueError) as e:
            logger.error("API keys not reloaded, the previous ones stay: %s", e)
            return False
        self._table, self._quotas = table, self._by_name(table)
        logger.info("API keys reloaded: %s", self.describe())
        return True

    def names(self) -> list[str]:
        return sorted({t.name for _, t in self._table})

    def describe(self) -> str:
        """For the log: how many keys of which tenants (never a key)."""
        if not self.required:
            return f"none (every client is {ANONYMOUS!r})"
        return f"{len(self._table)} key(s) of tenant(s) {', '.join(self.names())}"

    def __repr__(self) -> str:
        return f"Tenants({self.describe()})"
