"""The local autoscaler's loop (services/autoscale/loop.py) on a stand-in deployment whose instances' metrics
ports are one small HTTP server with canned pages: it reads the agreed signal names, turns counters and
histograms into readings over the interval (busy share, mean queueing time, TTFT and TPOT p90), leaves
draining instances out, and acts through the deployment's own methods."""

from __future__ import annotations

import importlib.util
import os
import socket
import subprocess
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from services.autoscale.loop import QUEUE_TIME, TPOT, TTFT, Autoscaler, histogram_quantile, lm_slots, scrape
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


def encoder_page(busy: float, depth: float, draining: int = 0, waited: float = 0.0, started: int = 0,
                 front: tuple[float, int] = (0.0, 0)) -> str:
    """``waited`` seconds over ``started`` requests: the encoder engine's vLLM queue-time histogram; ``front``:
    the seconds and calls of the service's own wait in front of the engine."""
    return (f"# TYPE epd_encoder_busy_seconds_total counter\nepd_encoder_busy_seconds_total {busy}\n"
            f"# TYPE epd_encoder_service_wait_seconds_total counter\nepd_encoder_service_wait_seconds_total {front[0]}\n"
            f"# TYPE epd_encoder_engine_requests_total counter\nepd_encoder_engine_requests_total {front[1]}\n"
            f"# TYPE epd_encoder_queue_depth gauge\nepd_encoder_queue_depth {depth}\n"
            f"# TYPE epd_instance_draining gauge\nepd_instance_draining {draining}\n"
            "# TYPE vllm:request_queue_time_seconds histogram\n"
            f'vllm:request_queue_time_seconds_bucket{{engine="0",le="+Inf"}} {started}\n'
            f'vllm:request_queue_time_seconds_count{{engine="0"}} {started}\n'
            f'vllm:request_queue_time_seconds_sum{{engine="0"}} {waited}\n')


def histogram(name: str, counts: dict[str, int]) -> str:
    """vLLM's histogram ``name`` with cumulative ``counts`` by bound, as two engines' halves (summed)."""
    lines = [f"# TYPE {name} histogram"]
    for engine in ("0", "1"):
        for le, c in counts.items():
            lines.append(f'{name}_bucket{{engine="{engine}",le="{le}"}} {c / 2}')
        lines.append(f'{name}_count{{engine="{engine}"}} {list(counts.values())[-1] / 2}')
    return "\n".join(lines) + "\n"


def lm_page(ttft: dict[str, int], tpot: dict[str, int]) -> str:
    return ('# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{engine="0"} 1\n'
            '# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{engine="0"} 1\n'
            + histogram("vllm:time_to_first_token_seconds", ttft)
            + histogram("vllm:request_time_per_output_token_seconds", tpot))


def test_the_loop_reads_the_signals_leaves_draining_instances_out_and_acts_through_the_deployment(servers):
    dep = FakeDeployment(servers)
    try:
        PAGES[servers[0]] = encoder_page(10.0, 6, waited=5.0, started=10)
        PAGES[servers[1]] = encoder_page(0.0, 0, draining=1)  # leaving: not capacity
        PAGES[servers[2]] = lm_page({"0.5": 10, "1.0": 10, "+Inf": 10}, {"0.05": 10, "0.1": 10, "+Inf": 10})
        PAGES[servers[3]] = ('# TYPE epd_gateway_objective_attainment gauge\n'
                             'epd_gateway_objective_attainment{objective="both"} 0.5\n'
                             'epd_gateway_objective_attainment{objective="ttft"} 0.9\n')
        assert scrape(servers[3])['epd_gateway_objective_attainment{objective="both"}'] == 0.5
        scaler = Autoscaler(dep, Budget(up_after_s=0, cooldown_s=0, max_encoders=3, tpot_s=0.1, max_memory_gib=1000),
                            lm_slots=4)
        snap = scaler.snapshot()
        assert [i.draining for i in snap.encoders] == [False, True]
        assert snap.encoders[0].memory_bytes > 0
        assert snap.encoders[0].queue_wait_s is None and snap.lms[0].ttft_s is None  # nothing to subtract yet
        time.sleep(0.2)
        # 0.1 s busy; 4 more waited 0.2 s in the engine and 0.4 s in front of it
        PAGES[servers[0]] = encoder_page(10.1, 0, waited=5.2, started=14, front=(0.4, 4))
        # 10 more first tokens, all between 0.5 and 1 s; 10 more requests at 50-100 ms a token
        PAGES[servers[2]] = lm_page({"0.5": 10, "1.0": 20, "+Inf": 20}, {"0.05": 10, "0.1": 20, "+Inf": 20})
        snap = scaler.snapshot()
        assert 0.05 < snap.encoders[0].busy < 0.9
        assert snap.encoders[0].queue_wait_s == pytest.approx(0.05 + 0.1)  # before its batch: both waits
        assert (snap.lms[0].ttft_s, snap.lms[0].tpot_s) == (pytest.approx(0.95), pytest.approx(0.095))
        live_port, dep.lms[0].metrics_port = dep.lms[0].metrics_port, _closed_port()  # a scrape that fails
        assert [i.tpot_s for i in scaler.snapshot().lms] == [pytest.approx(0.095)]  # alive: its last signals
        dep.lms[0].metrics_port = live_port

        # 4 more waited 1 s each in the engine, none in front of it: late
        PAGES[servers[0]] = encoder_page(20.0, 8, waited=9.2, started=18, front=(0.4, 8))
        actions = scaler.round()
        assert [(a.kind, a.role) for a in actions] == [("add", "encoder")]
        scaler.stop()  # waits for the action
        assert dep.calls == ["add_encoder"] and scaler.events[0]["ok"] is True
        sample = scaler.history[-1]
        assert (sample["encoders"], sample["lms"], sample["attainment"]) == (1, 1, 0.5)
        assert sample["encoder_lateness"] == pytest.approx(2.0) and sample["lm_held"] == 0.5

        gone = dep.encoders.pop()  # an instance that left the fleet: its readings are forgotten
        scaler.snapshot()
        assert gone.address not in scaler._seen and gone.address not in scaler._last
        dep.encoders.append(gone)  # closed with the others
    finally:
        dep.close()


def test_a_quantile_between_two_scrapes_is_interpolated_in_its_bucket():
    before = [(0.1, 5.0), (1.0, 5.0), (float("inf"), 5.0)]
    now = [(0.1, 5.0), (1.0, 15.0), (float("inf"), 15.0)]
    assert histogram_quantile(0.9, now, before) == pytest.approx(0.1 + 0.9 * 0.9)  # 10 new, all in 0.1..1
    assert histogram_quantile(0.9, now, now) is None  # nothing observed in between
    past = [(0.1, 0.0), (1.0, 0.0), (float("inf"), 4.0)]
    assert histogram_quantile(0.5, past, []) == 1.0  # past the last finite bound: that bound


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


def test_the_histograms_the_loop_reads_are_vllms_own():
    """vLLM's Prometheus logger (vllm/v1/metrics/loggers.py, read without importing vLLM) defines them, in the
    encoder's engine as in the LM's."""
    path = os.path.join(importlib.util.find_spec("vllm").submodule_search_locations[0], "v1", "metrics", "loggers.py")
    with open(path) as f:
        source = f.read()
    for name in (QUEUE_TIME, TTFT, TPOT):
        assert f'name="{name}"' in source, name
