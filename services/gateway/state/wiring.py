"""How one gateway process finds and opens the state its limits are decided on: the one path from the
``--state-store*`` flags (and a worker's seat) to a started ``SharedState``.

- ``--state-store`` set: the store every replica names, shared by ``--state-store-replicas`` replicas
  of ``--workers`` processes each (N, for each process's part while the store is unreachable).
- else a worker of ``--workers``: the private store its supervisor started (``WorkerSeat.store``),
  shared by the workers of this host.
- else: none, a ``LocalState`` (this process is the whole front door).

Owner: ``services.gateway.server.serve`` calls ``open_for`` before it builds the orchestrator, hands
the state to it (admission and background places), and closes it last, after everything that holds a
lease has given it back.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING

from services.gateway.state import SharedState, StateStoreConfig, open_state

if TYPE_CHECKING:
    from services.gateway.config import GatewayConfig
    from services.gateway.workers import WorkerSeat

logger = logging.getLogger(__name__)

HEARTBEATS_PER_LEASE = 3
"""Heartbeats in one ``--state-store-lease-s``: two may be lost (a busy moment) before a live process's
places are taken back."""


def store_config(cfg: GatewayConfig, seat: WorkerSeat | None = None) -> StateStoreConfig | None:
    """The store ``cfg`` (and ``seat``: this worker's place among ``--workers``) names; None: none. Raises
    ValueError for flags that do not describe one (``GatewayConfig`` checks them at parse time)."""
    workers, worker = (seat.count, seat.index) if seat is not None else (1, 0)
    common = {"lease_s": cfg.state_store_lease_s, "heartbeat_s": cfg.state_store_lease_s / HEARTBEATS_PER_LEASE,
              "unreachable": cfg.state_store_unreachable}
    if cfg.state_store_lease_s <= 0:
        raise ValueError(f"state_store_lease_s must be > 0, got {cfg.state_store_lease_s:g}")
    if cfg.state_store_replicas < 1 or not 0 <= cfg.state_store_replica < cfg.state_store_replicas:
        raise ValueError(f"state_store_replicas must be >= 1 and state_store_replica in 0..replicas-1, got "
                         f"{cfg.state_store_replicas}, {cfg.state_store_replica}")
    if cfg.state_store:
        return StateStoreConfig(url=cfg.state_store, password_file=cfg.state_store_password_file,
                                processes=cfg.state_store_replicas * workers,
                                index=cfg.state_store_replica * workers + worker, **common)
    private = seat.state_store() if seat is not None else None
    if private is None:
        StateStoreConfig(**common)  # the flags are checked even while no store uses them
        return None
    return dataclasses.replace(private, **common)


async def open_for(cfg: GatewayConfig, seat: WorkerSeat | None = None) -> SharedState:
    """The started state of this process (the caller closes it at shutdown). Raises ValueError when the
    store refuses this gateway (its password); a store that does not answer is no error: the process
    starts on its part of every limit and joins the store when it answers (``redis_state``)."""
    sc = store_config(cfg, seat)
    state = open_state(sc or StateStoreConfig())
    await state.start()
    if sc is not None:
        logger.info("gateway limits shared through the state store at %s (process %d of %d; lease %gs; while it "
                    "is unreachable: %s)", sc.url, sc.index + 1, sc.processes, sc.lease_s, sc.unreachable)
    return state
