"""bench/capacity.py: what it asks vLLM's benchmark client for, the knee it reports, and the
mixed workload it writes (no engines: the sweep itself runs by hand, see docs/benchmarks.md)."""

from __future__ import annotations

import argparse
import json
import os
import sys

import pytest

from tests.unit.helpers import load_bench

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def capacity():
    return load_bench("capacity")


def _args(**kw):
    base = dict(model="/m", num_prompts=30, workload="random-mm", input_len=64, output_len=32, image_size=224,
                image_every=10, slo_ttft_ms=2000.0, slo_tpot_ms=100.0, warmups=3)
    return argparse.Namespace(**{**base, **kw})


def _flag(argv: list[str], name: str):
    return argv[argv.index(name) + 1]


def test_the_client_runs_openai_chat_with_goodput_and_a_seed_per_rate(capacity, tmp_path):
    argv = capacity.bench_args(_args(), "http://h:1", "served", 2.0, str(tmp_path / "r.json"), "", seed=2000)
    assert _flag(argv, "--backend") == "openai-chat" and _flag(argv, "--request-rate") == "2.0"
    assert _flag(argv, "--seed") == "2000" and _flag(argv, "--dataset-name") == "random-mm"
    assert argv[argv.index("--goodput") + 1:argv.index("--goodput") + 3] == ["ttft:2000.0", "tpot:100.0"]
    assert json.loads(_flag(argv, "--random-mm-limit-mm-per-prompt")) == {"image": 1, "video": 0}
    mixed = capacity.bench_args(_args(workload="mixed"), "http://h:1", "s", 1.0, str(tmp_path / "r.json"), "d", 1)
    assert _flag(mixed, "--dataset-name") == "custom_image" and "--custom-ensure-client-side-data" in mixed


@pytest.mark.parametrize("attainments, knee", [([1.0, 1.0, 0.95, 0.5], 4), ([1.0, 0.5, 1.0, 1.0], 1),
                                               ([0.2, 1.0, 1.0, 1.0], None), ([1.0] * 4, 8)])
def test_the_knee_is_the_last_rate_before_attainment_first_drops(capacity, attainments, knee):
    rows = [{"rate": r, "attainment": a} for r, a in zip([1, 2, 4, 8], attainments)]
    assert capacity.knee(rows, 0.9) == knee


def test_the_mixed_workload_has_an_image_every_nth_request_and_differs_per_rate(capacity, tmp_path):
    capacity._mixed_dataset(str(tmp_path / "a.jsonl"), 20, 10, 32, offset=0)
    capacity._mixed_dataset(str(tmp_path / "b.jsonl"), 20, 10, 32, offset=1)
    a = [json.loads(line) for line in open(tmp_path / "a.jsonl")]
    b = [json.loads(line) for line in open(tmp_path / "b.jsonl")]
    with_image = [i for i, row in enumerate(a) if row["content"][0]["type"] == "image"]
    assert with_image == [9, 19] and all(os.path.exists(r["content"][0]["image"]) for r in (a[9], a[19]))
    assert a[0]["content"] != b[0]["content"]  # no rate finds another rate's prompts in a cache


def test_the_long_short_workload_has_a_long_prompt_every_nth_request(capacity, tmp_path):
    capacity._mixed_dataset(str(tmp_path / "a.jsonl"), 8, 0, 32, long_every=4, long_words=300)
    texts = [json.loads(line)["content"][-1]["text"] for line in open(tmp_path / "a.jsonl")]
    assert [len(t.split()) > 300 for t in texts] == [True, False, False, False] * 2


def test_cpu_seconds_names_each_service_and_what_it_started(tmp_path):
    """``System.cpu_seconds``: a service's own CPU under its role, its children's (vLLM's
    EngineCore) as ``<role> engine``."""
    import subprocess
    import time
    from types import SimpleNamespace

    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import serving

    from services.up import Service

    # The service burns nothing; the engine it starts burns about 0.3 s of CPU, then waits.
    child = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass\ntime.sleep(60)"
    parent = subprocess.Popen([sys.executable, "-c", f"import subprocess, sys, time\n"
                               f"subprocess.Popen([sys.executable, '-c', {child!r}])\ntime.sleep(60)"],
                              start_new_session=True)
    try:
        svc = Service("lm", [], str(tmp_path / "epd-lm.log"), proc=parent)
        fake = SimpleNamespace(name="epd", front=Service("gateway", [], str(tmp_path / "epd-gateway.log")),
                               engines=[(svc, None)])
        deadline = time.monotonic() + 30
        while (out := serving.System.cpu_seconds(fake)).get("lm engine", 0.0) < 0.25 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert set(out) == {"lm", "lm engine"} and out["lm engine"] >= 0.25 and out["lm"] < out["lm engine"]
    finally:
        os.killpg(parent.pid, 9)
        parent.wait()


def test_the_multi_image_workload_shares_its_text_and_has_2_to_max_images_new_images(capacity, tmp_path):
    capacity._multi_image_dataset(str(tmp_path / "a.jsonl"), 6, 32, offset=0, shared_words=50, max_images=4)
    capacity._multi_image_dataset(str(tmp_path / "b.jsonl"), 6, 32, offset=1, shared_words=50, max_images=4)
    a = [json.loads(line)["content"] for line in open(tmp_path / "a.jsonl")]
    b = [json.loads(line)["content"] for line in open(tmp_path / "b.jsonl")]
    assert len({row[0]["text"] for row in a + b}) == 1  # one shared text first, a system prompt's place
    images = [[p["image"] for p in row if p["type"] == "image"] for row in a]
    assert [len(i) for i in images] == [2, 3, 4, 2, 3, 4] and all(os.path.exists(p) for i in images for p in i)
    assert {open(p, "rb").read() for p in images[0]}.isdisjoint(
        open(p["image"], "rb").read() for row in b for p in row if p["type"] == "image")  # new images per rate
