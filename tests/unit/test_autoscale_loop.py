"""The local autoscaler's loop (services/autoscale/loop.py) on a stand-in deployment whose instances' metrics
ports are one small HTTP server with canned pages: it reads the agreed signal names, turns the busy counter
into a share, leaves draining instances out, and acts through the deployment's own methods."""

from __future__ import annotations

import os
import socket
import subprocess
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from services.autoscale.loop import Autoscaler, lm_slots, scrape
from services.autoscale.policy import Budget

PAGES: dict[int, str] = {}


class _Metrics(BaseHTTPRequestHandler):
    def do_GET(self):
        body = PAGES.get(self.server.server_port, "").encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def servers():
    made = []
    for _ in range(4):
        srv = ThreadingHTTPServer(("127.0.0.1", 0), _Metrics)
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        made.append(srv)
    yield [s.server_port for s in made]
    for s in made:
        s.shutdown()
        s.server_close()


class FakeService:
    def __init__(self, name: str, port: int) -> None:
        self.name, self.address, self.metrics_port = name, f"127.0.0.1:{1000 + port % 1000}", port
        self.proc = subprocess.Popen(["sleep", "60"])

    def alive(self) -> bool:
        return True


class FakeDeployment:
    def __init__(self, ports: list[int]) -> None:
        self.encoders = [FakeService("encoder", ports[0]), FakeService("encoder1", ports[1])]
        self.lms = [FakeService("lm", ports[2])]
        self.gateway_metrics = ports[3]
        self.calls: list[str] = []

    def members(self):
        return list(self.encoders), list(self.lms), set()

    def add_encoder(self, timeout):
        self.calls.append("add_encoder")
        return FakeService("encoder2", 9)

    def add_lm(self, timeout):
        self.calls.append("add_lm")
        return FakeService("lm1", 8)

    def remove(self, svc):
        self.calls.append(f"remove {svc.name}")
        return True

    def close(self) -> None:
        for svc in [*self.encoders, *self.lms]:
            svc.proc.kill()
            svc.proc.wait()


def encoder_page(busy: float, depth: float, draining: int = 0) -> str:
    return (f"# TYPE epd_encoder_busy_seconds_total counter\nepd_encoder_busy_seconds_total {busy}\n"
            f"# TYPE epd_encoder_queue_depth gauge\nepd_encoder_queue_depth {depth}\n"
            f"# TYPE epd_instance_draining gauge\nepd_instance_draining {draining}\n")


def test_the_loop_reads_the_signals_leaves_draining_instances_out_and_acts_through_the_deployment(servers):
    dep = FakeDeployment(servers)
    try:
        PAGES[servers[0]] = encoder_page(10.0, 6)
        PAGES[servers[1]] = encoder_page(0.0, 0, draining=1)  # leaving: not capacity
        PAGES[servers[2]] = ('# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{engine="0"} 1\n'
                             '# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{engine="0"} 1\n')
        PAGES[servers[3]] = ('# TYPE epd_gateway_objective_attainment gauge\n'
                             'epd_gateway_objective_attainment{objective="both"} 0.5\n'
                             'epd_gateway_objective_attainment{objective="ttft"} 0.9\n')
        assert scrape(servers[3])['epd_gateway_objective_attainment{objective="both"}'] == 0.5
        scaler = Autoscaler(dep, Budget(up_after_s=0, cooldown_s=0, max_encoders=3), lm_slots=4)
        snap = scaler.snapshot()
        assert [i.draining for i in snap.encoders] == [False, True]
        assert snap.encoders[0].queue == 6 and snap.encoders[0].memory_bytes > 0
        assert (snap.lms[0].running, snap.lms[0].waiting, snap.lms[0].slots) == (1, 1, 4)
        live_port, dep.lms[0].metrics_port = dep.lms[0].metrics_port, _closed_port()  # a scrape that fails
        assert [(i.running, i.waiting) for i in scaler.snapshot().lms] == [(1, 1)]  # alive: its last signals
        dep.lms[0].metrics_port = live_port
        time.sleep(0.2)
        PAGES[servers[0]] = encoder_page(10.1, 0)  # 0.1 s busy in about 0.2 s
        busy = scaler.snapshot().encoders[0].busy
        assert 0.05 < busy < 0.9

        PAGES[servers[0]] = encoder_page(20.0, 8)  # a queue of 8 (full at 4): load 2
        actions = scaler.round()
        assert [(a.kind, a.role) for a in actions] == [("add", "encoder")]
        scaler.stop()  # waits for the action
        assert dep.calls == ["add_encoder"] and scaler.events[0]["ok"] is True
        sample = scaler.history[-1]
        assert (sample["encoders"], sample["lms"], sample["attainment"]) == (1, 1, 0.5)
    finally:
        dep.close()


def test_each_lms_slots_come_from_its_flags_then_the_engine_arguments():
    assert lm_slots("{}", ["--max-num-seqs", "16"], 8) == 16
    assert lm_slots("{}", ["--max-num-seqs=32"], 8) == 32
    assert lm_slots('{"max_num_seqs": 4}', [], 8) == 4
    assert lm_slots("", None, 8) == 8


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_metrics_port_that_does_not_answer_reads_as_none():
    assert scrape(_closed_port()) is None
    assert os.path.exists("/proc")  # tree_rss reads /proc through psutil
