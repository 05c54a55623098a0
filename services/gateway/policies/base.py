"""The routing policies' interfaces, and the routing key every tie-break hashes.

``EncoderPolicy`` (``--encoder-routing``; ``services.gateway.fleet`` holds one, made at start):

- ``watches``: whether the encoder pool polls each admitted encoder's ``Holdings`` into the policy's
  directory after every passing health check (read once, by ``Fleet.__init__``).
- ``pick(key, candidates)`` (abstract): the encoder for the item whose content hash is ``key``; called
  by ``encoding.plan`` (through ``Fleet.pick_encoder``) once per item per attempt, on the event loop.
- ``sent(encoder, items)``: ``items`` were sent to ``encoder`` to encode; called by ``encoding.plan``
  right after each pick. No-op by default.

``LMPolicy`` (``--lm-routing``; the same):

- ``watches``: as above, for the LM pool.
- ``prefix(body)``: a request's prefix keys (``services.fleet_memory.prefix``), the LM's session id;
  called by the orchestrator once per request, before its first attempt. ``prefix.NONE`` by default.
- ``pick(candidates, request)`` (abstract): one LM among ``candidates`` for ``request``; called by
  ``Fleet.pick_lms`` once per attempt (for E -> P -> D: the prefill LM's pick).
- ``answered(lm, items, key)``: ``lm`` answered a request with media ``items`` and prefix key ``key``
  (its prefix cache now holds them); called by the orchestrator after each answered attempt. No-op by
  default.

Every pick is a function of the request (its content hashes, prefix keys, routing key) and the view of
the fleet (the candidates' addresses and outstanding calls, the directory), never of process-local
counters or randomness: two gateway replicas with the same view route the same request the same way.
A policy owns no instance and no directory: the fleet owns both and passes the directory in at start."""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from services.fleet_memory import prefix

if TYPE_CHECKING:
    from services.gateway.config import GatewayConfig
    from services.gateway.instances import Instance
    from services.gateway.lm_body import LMBody


@dataclass(frozen=True)
class LMRequest:
    """What an LM policy routes one request by: its media identifiers (in prompt order), its prefix
    keys and its routing key (``request_key``). Built by ``Fleet.pick_lms`` per attempt."""

    items: list[str] = field(default_factory=list)
    prefix: prefix.Prefix = prefix.NONE
    key: str = ""


def request_key(items: Sequence[str], keys: prefix.Prefix, body: Any = None) -> str:
    """A request's routing key, what every tie-break among equally busy instances hashes: its last prefix
    key, else its media identifiers, else a digest of its body (a JSON dict or the bytes as sent; a
    request with neither media nor prefix keys is text only, so its body is small). Derived from the
    request alone, so every gateway replica derives the same one."""
    if keys.keys:
        return keys.last
    if items:
        return ",".join(items)
    if body is None:
        return ""
    h = hashlib.blake2b(digest_size=16)
    if isinstance(body, bytes):
        h.update(body)
    else:
        prefix.feed(h, body)
    return "b:" + h.hexdigest()


class EncoderPolicy(ABC):
    """How an encoder is chosen for an item (the module docstring lists the primitives)."""

    watches: ClassVar[bool] = False

    def __init__(self, cfg: GatewayConfig, directory) -> None:
        """``directory``: the fleet's ``Directory`` of what each encoder holds (the fleet owns it)."""
        self.cfg, self.directory = cfg, directory

    @abstractmethod
    def pick(self, key: str, candidates: Sequence[Instance]) -> Instance | None: ...

    def sent(self, encoder: Instance, items: list[str]) -> None:
        return None


class LMPolicy(ABC):
    """How an LM is chosen for a request (the module docstring lists the primitives)."""

    watches: ClassVar[bool] = False

    def __init__(self, cfg: GatewayConfig, directory) -> None:
        """``directory``: the fleet's ``Directory`` of what each LM's prefix cache holds (the fleet owns it)."""
        self.cfg, self.directory = cfg, directory

    def prefix(self, body: LMBody | None) -> prefix.Prefix:
        return prefix.NONE

    @abstractmethod
    def pick(self, candidates: Sequence[Instance], request: LMRequest) -> Instance | None: ...

    def answered(self, lm: Instance, items: list[str], key: str = "") -> None:
        return None
