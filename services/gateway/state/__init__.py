"""State shared across gateway processes: the one owner of the counts that the front door's limits
(places per LM and per encoder, a tenant's ``max_in_flight``, background places, the
``images_per_minute`` rate; ``keys`` names them) are decided on when several gateway processes serve
one deployment. (The body budget is not among them: it bounds each process's own memory.)

Where the truth lives, how fresh a reader's view is, and what happens when that place is unreachable:

- One process, no store configured: ``LocalState``, in the process's memory; exact, nothing to reach.
- Several processes: ``RedisState``, in a Redis or Valkey store (``StateStoreConfig.url``): on one host
  the private one ``StoreServer`` starts, across hosts one the operator runs. Decisions are atomic in
  the store; a release reaches it one round trip later; places held by a process that died go back
  ``lease_s`` after its last heartbeat; an unreachable store makes each process hold its 1/N part of
  every limit (or refuse, ``unreachable="closed"``) until it answers again (``redis_state``'s docstring).

Modules: ``base`` (the ``SharedState`` interface, every primitive with its contract), ``local``,
``redis_state``, ``scripts`` (the store's Lua), ``bucket`` (rates in memory), ``config``,
``store_server``, ``keys`` (the names counted), ``wiring`` (flags to a started state). Importing this
package imports no Redis client; ``open_state`` does, for a store.
"""

from __future__ import annotations

from services.gateway.state.base import Lease, SharedState
from services.gateway.state.config import StateStoreConfig
from services.gateway.state.local import LocalState

__all__ = ["Lease", "LocalState", "SharedState", "StateStoreConfig", "open_state"]


def open_state(cfg: StateStoreConfig) -> SharedState:
    """The state for ``cfg``, not yet started (the caller awaits ``start()`` on its event loop, and
    ``close()`` at shutdown): a ``RedisState`` when a store is configured, else a ``LocalState``."""
    if not cfg.url:
        return LocalState()
    from services.gateway.state.redis_state import RedisState

    return RedisState(cfg)
