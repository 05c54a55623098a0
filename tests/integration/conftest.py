"""Fixtures shared by the integration tests."""

from __future__ import annotations

import pytest

from ectransfer.connector.config import ConnectorConfig
from ectransfer.connector.consumer import ConsumerScheduler
from tests.integration.connector_fakes import vllm_config
from tests.support.loopback import Producer


@pytest.fixture
def producer():
    """An encoder's producer side on loopback (real gRPC, a real outbound pool of 1 MiB), closed after the
    test. A module that needs another one defines its own ``producer``."""
    p = Producer(pool_bytes=1 << 20, ttl_s=60)
    yield p
    p.close()


@pytest.fixture
def consumer():
    """Makes consumer scheduler halves (the LM engine's side of the connector,
    without vLLM); shuts each down after the test."""
    made: list[ConsumerScheduler] = []

    def make(staging_bytes: int = 1 << 20, timeout_s: float = 10.0, **kw) -> ConsumerScheduler:
        cfg = ConnectorConfig(staging_bytes=staging_bytes, transfer_timeout_s=timeout_s, model_name="test-model",
                              **kw)
        made.append(ConsumerScheduler(vllm_config("lm-1"), cfg).start())
        return made[-1]

    yield make
    for sched in made:
        sched.shutdown()


@pytest.fixture(scope="module")
def store():
    """A real redis-server shared by one module's shared-state tests (each test in a namespace of its own)."""
    from tests.integration.redis_fixture import started_store

    server = started_store()
    yield server
    server.stop()


@pytest.fixture
def own_store():
    """A redis-server of the test's own, which it may freeze, stop and start again."""
    from tests.integration.redis_fixture import started_store

    server = started_store()
    yield server
    server.stop()
