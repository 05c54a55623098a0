"""Where an LM engine's CPU goes (issue 34's image tail): one system of ``bench/serving.py`` under the
``multi-image`` requests of ``bench/capacity.py`` at a fixed rate, and what its LM engine did, from vLLM's own
counters on that engine (prompt, cached and computed tokens, preemptions, engine steps) and the CPU its
processes used (the LM engine's process tree: vLLM's engine core and worker).

    python bench/lm_cpu.py epd --requests 60 --rate 1
    python bench/lm_cpu.py vllm-ec --requests 60 --rate 1
    python bench/lm_cpu.py epd --gateway-args "--dispatch sequential"     # the LM gets requests once encoded
    python bench/lm_cpu.py epd --lm-args "--no-holdings"                  # no KV events

Prints one JSON line. The numbers of docs/benchmarks.md ("Where the LM's extra CPU goes") came from it.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import re
import shlex
import sys
import tempfile
import threading
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import psutil
import serving
from capacity import LONG_WORDS

COUNTERS = ("prompt_tokens_total", "prompt_tokens_cached_total", "request_prefill_kv_computed_tokens_sum",
            "num_preemptions_total", "generation_tokens_total", "iteration_tokens_total_count")


def counters(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url, timeout=10) as r:
        return parse_counters(r.read().decode())


def parse_counters(text: str) -> dict[str, float]:
    """``COUNTERS`` from a Prometheus text page, each summed over its label sets."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = re.match(r"^vllm:(\w+)(?:\{[^}]*\})? ([0-9.eE+-]+)$", line)
        if m and m.group(1) in COUNTERS:
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(2))
    return out


def lm_engine(system: str) -> tuple[int, str]:
    """The LM engine's root process and the URL of its vLLM counters."""
    for proc in psutil.process_iter(["pid", "cmdline"]):
        argv = proc.info["cmdline"] or []
        line = " ".join(argv)
        if system == "vllm-ec" and "api_server" in line and "ec_consumer" in line:
            return proc.info["pid"], f"http://127.0.0.1:{argv[argv.index('--port') + 1]}/metrics"
        if system != "vllm-ec" and "services.cli" in argv and "lm" in argv and "--metrics-port" in argv:
            return proc.info["pid"], f"http://127.0.0.1:{argv[argv.index('--metrics-port') + 1]}/metrics"
    raise RuntimeError(f"no LM engine of {system} found")


def cpu_s(root: int) -> float:
    return sum(sum(p.cpu_times()[:2]) for p in psutil.Process(root).children(recursive=True))


def request(url: str, model: str, i: int) -> None:
    from tools.media import make_image

    shared = "You are a careful analyst. " + " ".join(LONG_WORDS[k % len(LONG_WORDS)] for k in range(250))
    content: list[dict] = [{"type": "text", "text": shared}]
    for j in range(2 + i % 2):
        data = base64.b64encode(make_image(90_000 + 100 * i + j, (224, 224))).decode()
        content += [{"type": "text", "text": f" Figure {j + 1}:"},
                    {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{data}"}}]
    content.append({"type": "text", "text": f" Compare the figures of case {i}."})
    body = {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 32,
            "temperature": 0, "ignore_eos": True}
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        r.read()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("system", choices=serving.SYSTEMS)
    p.add_argument("--requests", type=int, default=60)
    p.add_argument("--rate", type=float, default=1.0, help="requests per second (0: one after another)")
    p.add_argument("--lm-args", default="", help="extra flags for the LM service")
    p.add_argument("--gateway-args", default="", help="extra flags for the gateway")
    p.add_argument("--model", default=os.path.expanduser("~/.cache/epd-serve/bench-light-idefics3"))
    args = p.parse_args()
    extra = {"lm": shlex.split(args.lm_args), "gateway": shlex.split(args.gateway_args)}
    made = serving.Service

    def service(role, argv, *rest, **kw):  # the system's services, with the extra flags of their role
        return made(role, [*argv, *extra.get(argv[0] if argv else "", [])], *rest, **kw)

    serving.Service = service
    system = serving.start_system(args.system, args.model, [0, 1], tempfile.mkdtemp(prefix="lm-cpu-"), "{}")
    try:
        root, url = lm_engine(args.system)
        before, cpu0, t0 = counters(url), cpu_s(root), time.time()
        threads = []
        for i in range(args.requests):
            if args.rate:
                threads.append(threading.Thread(target=request, args=(system.url, args.model, i)))
                threads[-1].start()
                time.sleep(1 / args.rate)
            else:
                request(system.url, args.model, i)
        for t in threads:
            t.join()
        time.sleep(2)
        after = counters(url)
        print(json.dumps({"system": args.system, "lm_args": args.lm_args, "gateway_args": args.gateway_args,
                          "requests": args.requests, "rate": args.rate, "wall_s": round(time.time() - t0, 1),
                          "lm_engine_cpu_s": round(cpu_s(root) - cpu0, 1),
                          "vllm": {k: after.get(k, 0.0) - before.get(k, 0.0) for k in COUNTERS}}))
    finally:
        system.stop()


if __name__ == "__main__":
    main()
