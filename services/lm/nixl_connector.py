"""vLLM's NixlConnector with a guarded handshake listener: what prefill and decode LMs' engines load.

``services.lm.handoff.kv_transfer_config`` names this module as ``kv_connector_module_path`` and the
class ``NixlConnector``; vLLM's connector factory imports it in the EngineCore and the workers (the
module path wins over vLLM's own registry). The class keeps vLLM's name on purpose: vLLM's config and
its CPU platform switch NIXL-specific settings on by that name (``has_connector("NixlConnector")``:
the DS conv-state layout, the DCP checks), and they must stay on.

It is vLLM's pull connector with one part replaced, through subclasses only: the scheduler half's
``_nixl_handshake_listener`` (the target vLLM hands its ``nixl_handshake_listener`` thread, with the
encoded handshake payloads, the ready and stop events, host and port) runs
``services.lm.nixl_listener.HandshakeListener`` instead of vLLM's unguarded loop, admitting peers by
``services.lm.kv_peers.PeerCheck`` (its settings in ``kv_connector_extra_config[EXTRA_KEY]``).
The worker half, the transfers and the dialing side of the handshake are vLLM's, unchanged. vLLM
still owns the thread and stops it (its ``shutdown`` sets the stop event and joins).
"""

from __future__ import annotations

import threading
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import NixlPullConnector, NixlPullConnectorScheduler

from services.lm.kv_peers import EXTRA_KEY, PeerCheck
from services.lm.nixl_listener import HandshakeListener


class GuardedNixlScheduler(NixlPullConnectorScheduler):
    """vLLM's pull scheduler half whose handshake listener is ``HandshakeListener``."""

    def __init__(self, vllm_config, engine_id: str, kv_cache_config) -> None:
        super().__init__(vllm_config, engine_id, kv_cache_config)
        self.peer_check = PeerCheck.from_dict(vllm_config.kv_transfer_config.get_from_extra_config(EXTRA_KEY, {}))
        self.handshake_listener: HandshakeListener | None = None
        """The listener vLLM's thread runs (its port and counts), once vLLM set the handshake metadata."""

    def _nixl_handshake_listener(self, encoded_data: dict[tuple[int, int], Any], ready_event: threading.Event,
                                 stop_event: threading.Event, host: str, port: int) -> None:
        """vLLM's thread target (same arguments as its own listener): serves until ``stop_event``."""
        self.handshake_listener = HandshakeListener(encoded_data, host, port, self.peer_check)
        self.handshake_listener.run(ready_event, stop_event)


class NixlConnector(NixlPullConnector):
    """vLLM's ``NixlConnector`` (the pull connector) with ``GuardedNixlScheduler`` as its scheduler half.

    vLLM's ``__init__`` builds its own scheduler half first; that one is dropped unused (it starts no
    thread and binds nothing until its handshake metadata is set, which only ever reaches this one)."""

    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        if role == KVConnectorRole.SCHEDULER:
            self.connector_scheduler = GuardedNixlScheduler(vllm_config, self.engine_id, kv_cache_config)
