"""The encoder service reserves the Transfer port before the engine starts
(``services.encoder.server.reserve_port``) and the producer's Transfer server
binds that same port, so the service knows its endpoint up front."""

from __future__ import annotations

import socket

import grpc
import pytest

from ectransfer.connector.config import ConnectorConfig
from ectransfer.connector.producer import ProducerScheduler
from services.encoder.server import reserve_port
from tests.integration.connector_fakes import vllm_config

pytestmark = pytest.mark.integration


def test_the_producer_serves_on_the_port_the_service_reserved_and_nobody_else_can_take_it():
    reserved = reserve_port("127.0.0.1")
    port = reserved.getsockname()[1]
    ps = None
    try:
        with socket.socket() as other, pytest.raises(OSError):
            other.bind(("127.0.0.1", port))  # held while the engine starts
        ps = ProducerScheduler(vllm_config("enc-1"), ConnectorConfig(transfer_port=port, model_name="test-model",
                                                                    outbound_pool_bytes=1 << 20)).start()
        assert ps.server.bound_port == port
        reserved.close()  # as the service does once the engine is up
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            grpc.channel_ready_future(channel).result(timeout=10)
    finally:
        reserved.close()
        if ps is not None:
            ps.shutdown()


def test_a_fixed_transfer_port_in_use_is_refused_before_the_engine_starts():
    with socket.socket() as busy:
        busy.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)  # as a gRPC server's socket
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        with pytest.raises(OSError):
            reserve_port("127.0.0.1", busy.getsockname()[1]).close()
