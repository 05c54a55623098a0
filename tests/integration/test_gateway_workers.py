"""``epd gateway --workers 2`` as a user runs it (``gateway_processes``: the supervisor and its workers
as subprocesses, a stub LM behind them): both workers answer the REST and gRPC APIs on one port each,
one /metrics counts what every worker did, a worker killed with SIGKILL costs only the connections it
held and is replaced, and a stop leaves no worker, port, store or metrics file behind.

Which worker took a connection is up to the kernel (SO_REUSEPORT hashes each connection's addresses),
so "both workers answer" is asked of ``CONNECTIONS`` connections: all of them on one worker would take
odds of one in 2**31."""

from __future__ import annotations

import http.client
import json
import os
import signal
from pathlib import Path

import grpc
import psutil
import pytest

from epd.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from services.startup_errors import check_port
from tests.integration.gateway_processes import StubLM, WorkersGateway, client_port, exited, poll, reaped

pytestmark = pytest.mark.integration

CONNECTIONS = 32
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


def chats(gw: WorkersGateway, n: int) -> list:
    """``n`` chats, each on a connection of its own that stays open (keep-alive); the connections."""
    conns = [gw.connect() for _ in range(n)]
    for conn in conns:
        status, body = gw.call("POST", "/v1/chat/completions", CHAT, conn)
        assert status == 200 and body["choices"][0]["message"]["content"], body
    return conns


def grpc_chat(channel: grpc.Channel) -> list[dict]:
    stub = gateway_pb2_grpc.GatewayServiceStub(channel)
    req = gateway_pb2.OpenAIRequest(body=json.dumps({**CHAT, "stream": True}).encode())
    return [json.loads(m.body) for m in stub.ChatCompletion(req, timeout=60) if m.body]


def test_two_workers_both_answer_rest_and_grpc_on_one_port_each_and_one_metrics_page_counts_both(tmp_path):
    with StubLM(tmp_path) as lm, WorkersGateway(tmp_path, lm.address) as gw:
        pids = {w.pid for w in gw.workers()}
        conns = chats(gw, CONNECTIONS)
        owners = gw.owners(gw.port)
        assert {owners[client_port(c)] for c in conns} == pids  # every REST connection is a worker's; both have some

        channels = [grpc.insecure_channel(f"127.0.0.1:{gw.grpc_port}", options=[("grpc.use_local_subchannel_pool", 1)])
                    for _ in range(CONNECTIONS)]
        try:
            for channel in channels:
                assert grpc_chat(channel)[-1]["choices"][0]["finish_reason"]
            assert set(gw.owners(gw.grpc_port).values()) == pids  # both workers serve the gRPC port too
        finally:
            for channel in channels:
                channel.close()
        for conn in conns:
            conn.close()

        # Both workers' counts, on the internal port and on the public /metrics alike.
        poll(lambda: gw.metric("epd_gateway_requests_total", status="200"), lambda v: v == 2 * CONNECTIONS,
             "every REST and gRPC chat counted once")
        status, page = gw.call("GET", "/metrics")
        assert status == 200 and "epd_gateway_requests_total" in page
        assert gw.metric("epd_gateway_worker_starts_total") == 2
        assert "pid=" not in page  # gauges merged across workers: no per-process series on the public page


def test_every_route_answers_through_any_worker_and_a_stored_response_is_found_through_either(tmp_path):
    with StubLM(tmp_path) as lm, WorkersGateway(tmp_path, lm.address) as gw:
        assert gw.call("GET", "/health")[0] == 200
        assert gw.call("GET", "/v1/models")[1]["data"][0]["id"] == "stub-lm"
        assert gw.call("POST", "/v1/completions", {"prompt": "x", "max_tokens": 2})[0] == 200
        status, stream = gw.call("POST", "/v1/chat/completions", {**CHAT, "stream": True})
        assert status == 200 and stream.rstrip().endswith("data: [DONE]")
        status, created = gw.call("POST", "/v1/responses", {"input": "hi", "max_output_tokens": 2})
        assert status == 200, created
        # One worker minted the id; each fetch below is a new connection, to whichever worker the kernel
        # picks: the workers share the secret the ids are signed with.
        conns = [gw.connect() for _ in range(CONNECTIONS)]
        for conn in conns:
            status, got = gw.call("GET", f"/v1/responses/{created['id']}", conn=conn)
            assert status == 200 and got["id"] == created["id"], got
        owners = gw.owners(gw.port)  # every connection is accepted now: it was answered
        assert len({owners[client_port(c)] for c in conns}) == 2
        for conn in conns:
            conn.close()


def test_a_worker_killed_with_sigkill_costs_only_its_own_connections_and_is_replaced(tmp_path):
    with StubLM(tmp_path) as lm, WorkersGateway(tmp_path, lm.address) as gw:
        conns = chats(gw, CONNECTIONS)
        held = gw.owners(gw.port)
        owners = {client_port(c): held[client_port(c)] for c in conns}
        victim = owners[client_port(conns[0])]
        survivor = next(w.pid for w in gw.workers() if w.pid != victim)
        metrics_dir = Path(psutil.Process(survivor).environ()["PROMETHEUS_MULTIPROC_DIR"])
        assert (metrics_dir / f"gauge_livesum_{victim}.db").exists()
        os.kill(victim, signal.SIGKILL)
        poll(lambda: reaped(victim), bool, "the supervisor reaped the killed worker (its sockets are closed)")
        poll(lambda: list(metrics_dir.glob(f"gauge_live*_{victim}.db")), lambda left: not left,
             "the killed worker's live gauges dropped from the merged metrics")

        chats(gw, CONNECTIONS)  # new connections, none retried: every one reaches the survivor (or the replacement)
        for conn in conns:  # the open ones: the survivor's keep serving, the victim's are closed
            if owners[client_port(conn)] == survivor:
                assert gw.call("POST", "/v1/chat/completions", CHAT, conn)[0] == 200
            else:
                with pytest.raises((OSError, http.client.HTTPException)):
                    gw.call("POST", "/v1/chat/completions", CHAT, conn)
            conn.close()
        answered = 2 * CONNECTIONS + sum(pid == survivor for pid in owners.values())

        replaced = {w.pid for w in gw.wait_ready()} - {survivor}
        assert len(replaced) == 1 and victim not in replaced
        conns = chats(gw, CONNECTIONS)
        assert replaced <= set(gw.owners(gw.port).values())  # the replacement serves
        for conn in conns:
            conn.close()
        # The killed worker's counts stay in the merged page.
        poll(lambda: gw.metric("epd_gateway_requests_total", route="chat", status="200"),
             lambda v: v == answered + CONNECTIONS, "every answered chat counted, the dead worker's too")
        assert gw.metric("epd_gateway_worker_starts_total") == 3


def test_sigterm_stops_every_worker_and_leaves_no_port_store_or_metrics_file(tmp_path):
    with StubLM(tmp_path) as lm, WorkersGateway(tmp_path, lm.address) as gw:
        workers = gw.workers()
        metrics_dir = workers[0].environ()["PROMETHEUS_MULTIPROC_DIR"]
        store = Path(gw.seat(workers[0]).store.removeprefix("unix://")).parent
        store_pid = gw.store_pid()
        assert os.path.isdir(metrics_dir) and store.is_dir() and store_pid
        gw.proc.send_signal(signal.SIGTERM)
        assert gw.proc.wait(120) == 0
        assert all(reaped(w.pid) for w in workers) and exited(store_pid)
        assert not os.path.exists(metrics_dir) and not store.exists()
        for port in (gw.port, gw.grpc_port, gw.metrics_port):
            check_port("--port", "127.0.0.1", port)  # free again


def test_workers_and_the_private_store_whose_supervisor_was_killed_stop_by_themselves(tmp_path):
    with StubLM(tmp_path) as lm, WorkersGateway(tmp_path, lm.address) as gw:
        workers = gw.workers()
        assert gw.store is not None, "two workers and no --state-store: the supervisor starts a private store"
        gw.proc.kill()
        gw.proc.wait()
        for w in workers:
            poll(lambda w=w: exited(w.pid), bool, f"worker {w.pid} stopped")
        poll(lambda: exited(gw.store), bool, f"the private store {gw.store} stopped")
