"""bench/hostile.py's pure helpers: the sizes of the hostile bodies it sends (exactly at the
gateway's limits, and accepted by the gateway's own checks when meant to be valid), how clients
are split, and how answers, metrics and Kubernetes quantities are read (no servers: the benchmark
itself runs by hand, see docs/benchmarks.md)."""

from __future__ import annotations

import json
import os

import pytest

from epd.gateway.v1 import gateway_pb2
from services.gateway.config import GatewayConfig
from services.gateway.fetch import check_format, decode_data_url
from services.gateway.request import parse_openai
from tests.unit.helpers import load_bench

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def hostile():
    return load_bench("hostile")


@pytest.fixture
def small_cfg():
    """Limits small enough to build at-limit bodies quickly (max_body_bytes a little over 1 MiB)."""
    return GatewayConfig(lms="127.0.0.1:1", max_image_bytes=30_001, max_audio_bytes=1000, max_video_bytes=1000)


def test_clients_are_split_evenly_and_all_of_them_are_used(hostile):
    counts = hostile.split_clients(64, ["a", "b", "c", "d", "e", "f"])
    assert counts == {"a": 11, "b": 11, "c": 11, "d": 11, "e": 10, "f": 10}
    assert sum(hostile.split_clients(5, ["a", "b", "c"]).values()) == 5


@pytest.mark.parametrize("total", [3, 127, 128, 129, 131, 16386, 90_527_061, 90_527_062])
def test_grpc_body_len_makes_a_message_of_exactly_the_size_asked(hostile, total):
    n = hostile.grpc_body_len(total)
    assert gateway_pb2.OpenAIRequest(body=bytes(n)).ByteSize() == total


@pytest.mark.parametrize("total", [1, 2, 130])
def test_grpc_body_len_refuses_a_size_no_body_makes(hostile, total):
    with pytest.raises(ValueError):
        hostile.grpc_body_len(total)


def test_invalid_at_limit_body_is_that_many_bytes_of_non_json(hostile, small_cfg):
    body = hostile.at_limit_body(small_cfg.max_body_bytes, small_cfg, False, "m")
    assert len(body) == small_cfg.max_body_bytes
    with pytest.raises(ValueError):
        json.loads(body)


def test_valid_at_limit_body_is_exactly_the_limit_and_passes_the_gateways_checks(hostile, small_cfg):
    size = small_cfg.max_body_bytes
    body = hostile.at_limit_body(size, small_cfg, True, "m")
    assert len(body) == size
    call = parse_openai("chat", body, small_cfg)
    assert call.modalities == ["image", "image"]
    for url in call.sources:  # each image the largest the gateway takes, and a real PNG
        data = decode_data_url(url, small_cfg.max_image_bytes)
        assert small_cfg.max_image_bytes - 3 < len(data) <= small_cfg.max_image_bytes
        assert check_format(data, small_cfg.max_image_pixels) == "PNG"


def test_valid_body_drops_images_that_do_not_fit(hostile, small_cfg):
    body = hostile.at_limit_body(50_000, small_cfg, True, "m")  # one 30 kB image, base64, fits; two do not
    assert len(body) == 50_000
    assert parse_openai("chat", body, small_cfg).modalities == ["image"]


@pytest.mark.parametrize("quantity, expected", [("1Gi", 1 << 30), ("2560Mi", 2560 << 20), ("512Ki", 512 << 10),
                                                ("2G", 2_000_000_000), ("1500M", 1_500_000_000), ("1048576", 1 << 20),
                                                ("1.5Gi", 3 << 29)])
def test_k8s_memory_quantities_are_read_in_bytes(hostile, quantity, expected):
    assert hostile.k8s_bytes(quantity) == expected


def test_a_k8s_quantity_that_is_not_memory_is_refused(hostile):
    with pytest.raises(ValueError):
        hostile.k8s_bytes("500m")


def test_the_manifests_gateway_memory_limit_is_found(hostile):
    assert hostile.manifest_memory_limit() > 0


def test_intake_metrics_are_read_from_the_prometheus_page(hostile):
    page = ('# HELP epd_gateway_body_bytes_held Budget\nepd_gateway_body_bytes_held 8.1e+08\n'
            'epd_gateway_bodies_reading 3.0\nepd_gateway_bodies_refused_total{reason="size"} 12.0\n'
            'epd_gateway_bodies_refused_created{reason="size"} 1.7e+09\n'
            'epd_gateway_bodies_refused_total{reason="memory"} 2.0\n')
    assert hostile.parse_metrics(page) == {"held": 8.1e8, "reading": 3.0, "refused:size": 12.0,
                                           "refused:memory": 2.0}


def test_legit_summary_counts_failures_but_takes_latency_from_answered_requests_only(hostile):
    samples = [(0.5, "rest", 0.010, "ok"), (1.0, "rest", 0.020, "ok"), (1.5, "rest", 5.0, "503"),
               (1.5, "grpc", 0.004, "ok"), (2.5, "rest", 0.001, "ok")]  # the last is outside the window
    out = hostile.summarize_legit(samples, 0.0, 2.0)
    assert out["rest"]["n"] == 3 and out["rest"]["ok"] == 2 and out["rest"]["outcomes"] == {"ok": 2, "503": 1}
    assert out["rest"]["p99_ms"] == 20.0 and out["rest"]["p50_ms"] == 15.0
    assert out["all"]["n"] == 4 and out["all"]["success"] == 0.75 and list(out)[-1] == "all"


def test_hostile_summary_counts_answers_per_kind_and_keeps_kinds_with_none(hostile):
    events = [(0.0, 0.1, "rest-declared", "413"), (0.1, 0.2, "rest-declared", "413"), (0.0, 30.0, "rest-drip", "408")]
    out = hostile.summarize_hostile(events, {"rest-declared": 1, "rest-drip": 2, "grpc-over": 1})
    assert out["rest-declared"]["outcomes"] == {"413": 2} and out["rest-declared"]["requests"] == 2
    assert out["rest-drip"]["max_s"] == 30.0 and out["rest-drip"]["clients"] == 2
    assert out["grpc-over"]["requests"] == 0 and out["grpc-over"]["median_s"] is None


def test_note_keeps_the_first_message_and_reads_openai_errors(hostile):
    details = {}
    assert hostile.note(details, "503", '{"error": {"message": "full  now", "code": 503}}') == "503"
    hostile.note(details, "503", "second")
    assert details == {"503": "full now"}


def test_json_keeps_every_value_and_writes_each_series_on_one_line(hostile, tmp_path):
    doc = {"machine": {"cores": 2}, "phases": [{"phase": "baseline"}],
           "rss_samples": [(0.0, 252.1), (0.05, 252.3)], "legit_samples": [(0.1, "rest", 2.5, "ok")]}
    path = tmp_path / "h.json"
    hostile.write_json(str(path), doc)
    assert json.loads(path.read_text()) == json.loads(json.dumps(doc))
    assert ' "rss_samples": [[0.0,252.1],[0.05,252.3]],' in path.read_text().splitlines()


def test_admission_and_background_gauges_are_read_and_in_flight_summed_over_what_it_holds(hostile):
    page = ('epd_gateway_admission_in_flight{holds="lm"} 3.0\nepd_gateway_admission_in_flight{holds="encoder"} 2.0\n'
            'epd_gateway_admission_waiting 7.0\nepd_gateway_background_held 16.0\n'
            'epd_gateway_slow_readers_total 4.0\nepd_gateway_slow_readers_created 1.7e+09\n')
    assert hostile.parse_metrics(page) == {"in_flight": 5.0, "waiting": 7.0, "background": 16.0, "slow_readers": 4.0}


def test_keys_file_has_a_line_per_tenant_with_its_quota_merged_in(hostile):
    lines = hostile.keys_file_lines({"legit": "k1", "attacker": "k2"}, {"attacker": {"max_in_flight": 8}})
    assert [json.loads(x) for x in lines] == [{"tenant": "legit", "key": "k1"},
                                              {"tenant": "attacker", "key": "k2", "max_in_flight": 8}]


def test_release_is_the_first_scrape_after_the_attack_that_holds_nothing(hostile):
    held = {"held": 8.0, "in_flight": 0.0, "waiting": 0.0, "background": 0.0}
    metrics = [(0.5, {**held, "held": 0.0}), (1.0, held), (1.2, {**held, "held": 0.0, "background": 2.0}),
               (1.4, {}), (1.6, {**held, "held": 0.0})]
    assert hostile.released_at(metrics, 0.9) == 1.6  # a failed scrape ({}) is not a release
    assert hostile.released_at(metrics[:3], 0.9) is None


@pytest.mark.parametrize("workers, choice, gateway, others", [
    (1, "auto", {3}, {0, 1, 2}),  # one event loop: a core of its own
    (2, "auto", {0, 1, 2, 3}, {0, 1, 2, 3}),  # workers: every core, shared
    (1, "all", {0, 1, 2, 3}, {0, 1, 2, 3}),
    (2, "2", {2, 3}, {0, 1}),
])
def test_gateway_cores_follow_the_choice_and_the_worker_count(hostile, workers, choice, gateway, others):
    assert hostile.gateway_cores([0, 1, 2, 3], workers, choice) == (gateway, others)


def test_on_one_core_everything_shares_it(hostile):
    assert hostile.gateway_cores([5], 1, "auto") == ({5}, {5})


@pytest.mark.parametrize("choice", ["0", "5", "two"])
def test_a_gateway_core_count_the_host_does_not_have_is_refused(hostile, choice):
    with pytest.raises(ValueError):
        hostile.gateway_cores([0, 1, 2, 3], 1, choice)


@pytest.fixture(scope="module")
def workers_bench():
    return load_bench("hostile_workers")


def _run(p99_x: float, grpc: float) -> dict:
    phase = {"rest_success": 1.0, "grpc_success": 1.0, "p50_ms": 4.0, "p99_ms": 40.0, "gateway_cpu_pct": 30}
    return {"baseline": phase, "attacks": [dict(phase, attack="rest-at-limit", grpc_success=grpc, p99_ms=40.0 * p99_x,
                                                p99_vs_baseline=p99_x, rss_hwm_mib=900.0, released_s=0.2)]}


def test_worker_runs_are_compared_per_attack_against_each_runs_own_baseline(workers_bench):
    rows = workers_bench.compare({1: _run(80.0, 0.8), 2: _run(4.9, 0.995)})
    one, two = [r for r in rows if r["attack"] == "rest-at-limit"]
    assert one["workers"] == 1 and one["met"] == {"success_99": False, "p99_5x": False}
    assert two["workers"] == 2 and two["met"] == {"success_99": True, "p99_5x": True}
    assert [r["attack"] for r in rows if r["workers"] == 1] == ["baseline", "rest-at-limit"]


def test_comparison_table_has_a_row_per_phase_and_run_and_says_which_target_is_missed(workers_bench):
    text = workers_bench.table(workers_bench.compare({1: _run(80.0, 1.0), 2: _run(2.0, 0.5)}))
    lines = text.splitlines()
    assert len(lines) == 6 and lines[2].startswith("| baseline | 1 |") and lines[3].startswith("| baseline | 2 |")
    assert lines[4].endswith("| no (p99) |") and lines[5].endswith("| no (ok %) |")


def test_p99_is_also_read_against_the_first_runs_baseline(workers_bench):
    runs = {1: _run(80.0, 1.0), 2: _run(2.0, 1.0)}
    runs[2]["baseline"] = dict(runs[2]["baseline"], p99_ms=400.0)  # a noisy baseline: 10x the first run's
    two = [r for r in workers_bench.compare(runs) if r["workers"] == 2]
    assert [r["p99_x_first"] for r in two] == [10.0, 2.0]


def test_cpu_shares_split_the_hosts_busy_time_between_the_gateway_the_bench_and_others(hostile):
    got = hostile.cpu_shares([(10.0, 1.0, 2.0, 100.0, 0.0), (12.0, 2.0, 3.0, 103.0, 0.2)])
    assert got == {"bench_cpu_pct": 50, "host_cpu_pct": 150, "other_cpu_pct": 50, "steal_pct": 10}
    assert hostile.cpu_shares([(10.0, 1.0, 2.0, 100.0, 0.0)])["host_cpu_pct"] is None


def test_combined_json_keeps_every_run_and_writes_each_series_on_one_line(workers_bench, tmp_path):
    doc = {"machine": {"cores": 2}, "comparison": [], "runs": {
        1: {"baseline": {}, "legit_samples": [[0.1, "rest", 2.5, "ok"], [0.2, "grpc", 3.0, "ok"]]},
        2: {"baseline": {}, "rss_samples": [[0.0, 252.1]]}}}
    path = tmp_path / "w.json"
    workers_bench.write_json(str(path), doc)
    assert json.loads(path.read_text()) == json.loads(json.dumps(doc))
    assert any(line.strip() == '"legit_samples": [[0.1,"rest",2.5,"ok"],[0.2,"grpc",3.0,"ok"]]'
               for line in path.read_text().splitlines())
