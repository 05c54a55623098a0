"""``EPDConnector``: epd-serve's vLLM EC connector, one class for both roles.

Load it with::

    --ec-transfer-config '{"ec_connector": "EPDConnector",
                           "ec_connector_module_path": "ectransfer.connector",
                           "ec_role": "ec_producer" | "ec_consumer",
                           "ec_connector_extra_config": {...ConnectorConfig...}}'

vLLM builds it twice per engine: role SCHEDULER in the EngineCore's scheduler
and role WORKER in each worker. This facade picks the matching half:

    producer, scheduler: ProducerScheduler  outbound pool + reservations + Transfer server
    producer, worker:    ProducerWorker     copies encoder outputs into reserved slots
    consumer, scheduler: ConsumerScheduler  reserves staging, pulls items, defers requests
    consumer, worker:    ConsumerWorker     injects staged bytes into vLLM's encoder cache

Every hook returns fast; network I/O runs on the halves' own threads. In the
EngineCore, ``lifeline`` stops the engine once the service that started it is gone.
"""

from __future__ import annotations

from typing import Any

__all__ = ["EPDConnector", "ConnectorConfig", "ConnectorTuning"]


def __getattr__(name: str) -> Any:
    """Imports lazily: vLLM loads ``EPDConnector`` by name from this package, while the
    services import the configuration without importing vLLM."""
    if name == "EPDConnector":
        from ectransfer.connector.facade import EPDConnector

        return EPDConnector
    if name in ("ConnectorConfig", "ConnectorTuning"):
        from ectransfer.connector import config

        return getattr(config, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
