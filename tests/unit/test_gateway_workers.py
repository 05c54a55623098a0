"""The pieces of ``services.gateway.workers`` that need no process: the replacement backoff, the seat a
worker is told, its command line and environment (the configuration round-trips through the flags; the
API keys never reach a command line), the port reservation, and the ``--workers`` check."""

from __future__ import annotations

import argparse
import socket

import pytest

from peerauth import SecurityConfig
from services.common.config import add_dataclass_args, from_args, to_args
from services.gateway.config import API_KEYS_ENV, GatewayConfig
from services.gateway.metrics import MULTIPROCESS_DIR_ENV
from services.gateway.responses import SECRET_ENV
from services.gateway.workers import Backoff, WorkerSeat, reserve, worker_argv, worker_env
from services.startup_errors import StartupError

pytestmark = pytest.mark.unit


def test_the_backoff_doubles_for_quick_deaths_up_to_its_bound_and_starts_over_after_a_stable_run():
    backoff = Backoff(first_s=0.5, most_s=4.0, stable_s=30.0)
    assert [backoff.after(1.0) for _ in range(6)] == [0.5, 1.0, 2.0, 4.0, 4.0, 4.0]
    assert backoff.after(30.0) == 0.5
    assert backoff.after(0.1) == 1.0


def test_a_seat_round_trips_through_its_flag_and_names_the_workers_part_of_the_store():
    seat = WorkerSeat(123, 1, 3, joining=True, store="unix:///tmp/x/redis.sock", store_password_file="/tmp/x/password")
    assert WorkerSeat.from_flag(seat.to_flag()) == seat
    store = seat.state_store()
    assert (store.url, store.password_file, store.processes, store.index) == (seat.store, seat.store_password_file, 3, 1)
    assert WorkerSeat(123, 0, 2).state_store() is None


@pytest.mark.parametrize("flag", ["", "{", "[]", '{"supervisor": 1}', '{"supervisor": 1, "index": 2, "count": 2}',
                                  '{"supervisor": 1, "index": 0, "count": 1, "other": 3}'])
def test_a_seat_that_is_not_one_is_refused(flag):
    with pytest.raises(ValueError, match="--worker-of"):
        WorkerSeat.from_flag(flag)


def test_a_configuration_round_trips_through_the_flags_it_is_given_as():
    cfg = GatewayConfig(lms="a:1,b:2", workers=3, epd_facts=True, local_encode_fallback=False, request_timeout_s=0.25,
                        model_name="-starts-with-a-dash", encoder_routing="affinity")
    parser = argparse.ArgumentParser()
    add_dataclass_args(parser, GatewayConfig)
    assert from_args(GatewayConfig, parser.parse_args(to_args(cfg))) == cfg
    assert to_args(GatewayConfig(lms="a:1")) == ["--lms=a:1"]  # defaults are left out


def test_a_worker_gets_its_keys_and_the_state_secret_in_its_environment_never_on_its_command_line(tmp_path):
    cfg = GatewayConfig(lms="a:1", workers=2, api_key=["key-one", "key-two"])
    token = tmp_path / "token"
    token.write_text("t" * 32)
    argv = worker_argv(cfg, SecurityConfig(auth_token_file=str(token)), WorkerSeat(1, 0, 2), "info")
    assert not any("key-one" in a for a in argv)
    assert argv[argv.index("--worker-of") + 1] == WorkerSeat(1, 0, 2).to_flag()
    assert f"--auth-token-file={token}" in argv and "--workers=2" in argv
    env = worker_env(cfg, "/tmp/m", "s" * 64)
    assert env[API_KEYS_ENV] == "key-one\nkey-two" and env[MULTIPROCESS_DIR_ENV] == "/tmp/m" and env[SECRET_ENV] == "s" * 64


def test_a_reserved_port_lets_workers_listen_beside_it_and_keeps_every_other_socket_off():
    held = reserve("--port", "127.0.0.1", 0)
    port = held.getsockname()[1]
    try:
        workers = []
        for _ in range(2):  # what aiohttp's reuse_port and grpcio's so_reuseport do
            s = socket.socket()
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            s.bind(("127.0.0.1", port))
            s.listen()
            workers.append(s)
        other = socket.socket()
        other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        with pytest.raises(OSError):
            other.bind(("127.0.0.1", port))
        other.close()
        for s in workers:
            s.close()
        with pytest.raises(StartupError, match="in use"):  # held while no worker listens, too
            reserve("--port", "127.0.0.1", port)
    finally:
        held.close()


def test_fewer_than_one_worker_is_refused():
    with pytest.raises(ValueError, match="workers must be >= 1"):
        GatewayConfig(lms="a:1", workers=0)
