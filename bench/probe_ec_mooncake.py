"""Checks that vLLM's ECMooncakeConnector runs on this host, before ``bench/capacity.py`` measures it.

``make bench-mooncake`` installs Mooncake's transfer engine without CUDA
(``mooncake-transfer-engine-non-cuda`` into the venv; Debian's ``libibverbs1``, ``libnl-3-200`` and
``libnl-route-3-200``, which its extension links even for TCP, by apt-get as root or unpacked into
``.venv/mooncake-libs``). This probe then checks, in turn:

1. ``engine``: two transfer engines in this process, started as the connector starts them (P2P handshake,
   TCP), one writes a buffer into the other's registered memory with ``batch_transfer_sync_write``;
   the bytes must arrive exactly.
2. ``system`` (``--system``): ``bench/serving.py``'s ``vllm-mooncake`` (an ec_producer and an
   ec_consumer vLLM server behind ``bench/mooncake_proxy.py``) answers image chats (one and two images)
   with greedy decoding while text chats keep its consumer stepping (``check_system`` says why), and
   every answer's token ids must equal plain vLLM's on the same request (``tools.reference``, the
   project's exactness oracle).

    python bench/probe_ec_mooncake.py            # the engine check
    python bench/probe_ec_mooncake.py --system   # and the system check (a few minutes on 2 cores)

Prints one line per check and exits 1 on the first failure.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

ENGINE = """
import ctypes, os, time
from mooncake.engine import TransferEngine

n = 8 << 20
a, b = TransferEngine(), TransferEngine()
assert a.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0, "initialize a"
assert b.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0, "initialize b"
src, dst = ctypes.create_string_buffer(os.urandom(n), n), ctypes.create_string_buffer(n)
for e, buf in ((a, src), (b, dst)):
    assert e.register_memory(ctypes.addressof(buf), n) == 0, "register_memory"
t0 = time.perf_counter()
ret = a.batch_transfer_sync_write(f"127.0.0.1:{b.get_rpc_port()}", [ctypes.addressof(src)],
                                  [ctypes.addressof(dst)], [n])
ms = (time.perf_counter() - t0) * 1e3
assert ret == 0, f"batch_transfer_sync_write returned {ret}"
assert src.raw == dst.raw, "bytes differ"
print(f"ENGINE ok: 8 MiB CPU-to-CPU over tcp, byte-exact, {ms:.0f} ms")
"""


def check_engine() -> bool:
    from serving import mooncake_env

    env = dict(os.environ, **mooncake_env())
    proc = subprocess.run([sys.executable, "-c", ENGINE], capture_output=True, text=True, env=env, timeout=120)
    lines = [ln for ln in (proc.stdout + proc.stderr).splitlines() if ln.startswith(("ENGINE", "Traceback", "Assert",
                                                                                    "ImportError", "OSError"))]
    print("engine:", lines[-1] if lines else (proc.stdout + proc.stderr).strip().splitlines()[-1:])
    return proc.returncode == 0


def _requests(n_images: int) -> list[dict]:
    """``n_images`` one-image chats, one two-image chat, and last the text chat that, sent again and
    again, keeps the consumer stepping while they are served (``check_system``)."""
    from tools.media import data_url, make_image

    reqs = []
    for i in range(n_images):
        url = data_url(make_image(4242 + i, (224, 224)))
        reqs.append({"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": f"Describe picture {i}."}]}]})
    reqs.append({"messages": [{"role": "user", "content": [  # two images in one request
        *({"type": "image_url", "image_url": {"url": data_url(make_image(777 + j, (224, 224)))}} for j in range(2)),
        {"type": "text", "text": "Compare them."}]}]})
    for r in reqs:
        r.update(max_tokens=16, temperature=0, ignore_eos=True)
    reqs.append({"messages": [{"role": "user", "content": "Tell a long story."}], "max_tokens": 128,
                 "temperature": 0, "ignore_eos": True})
    return reqs


def _ask(url: str, body: dict, timeout: float = 300) -> tuple[list[int] | str, float]:
    """Token ids of a non-streamed chat (or the error), and its seconds."""
    req = urllib.request.Request(url, data=json.dumps({**body, "return_token_ids": True}).encode(),
                                 headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.load(r)["choices"][0]["token_ids"], time.perf_counter() - t0
    except (OSError, ValueError) as e:  # HTTP errors and timeouts are the answer here
        return repr(e)[:200], time.perf_counter() - t0


def check_system(model: str, cores: list[int], lone: bool) -> bool:
    """Image requests are sent while text requests decode, one after another: on vLLM's V1 model runner
    (the only one on CPU: V2 needs Triton) an engine step with no scheduled tokens returns before the EC
    connector runs, so a consumer with nothing else to do never starts loading a push it holds, and its
    request fails after ``push_wait_timeout_s`` (60 s). ``lone`` also measures that (about 2 minutes:
    the proxy retries once)."""
    from serving import start_system

    from tools.reference import run_subprocess

    reqs = _requests(2)
    logdir = tempfile.mkdtemp(prefix="mooncake-probe-")
    system = start_system("vllm-mooncake", model, cores, logdir, "{}")
    try:
        if lone:
            out, secs = _ask(system.url, reqs[0])
            print(f"system: a lone image request: {'ok' if isinstance(out, list) else out} after {secs:.0f} s")
        done, steps = threading.Event(), []  # text answers, with their seconds

        def step() -> None:  # the text request, again and again until the image requests are answered
            while not done.is_set():
                steps.append(_ask(system.url, reqs[-1], 900))

        thread = threading.Thread(target=step, name="probe-stepper")
        thread.start()
        time.sleep(2)
        try:
            got = [_ask(system.url, r) for r in reqs[:-1]]
        finally:
            done.set()
            thread.join()
        with urllib.request.urlopen(f"http://127.0.0.1:{system.port}/stats", timeout=10) as r:
            stats = json.load(r)
    finally:
        system.stop()
    print(f"system: {len(got)} image requests answered in {', '.join(f'{t:.1f}' for _, t in got)} s while "
          f"{len(steps)} text requests decoded; proxy {stats}; logs in {logdir}", flush=True)
    try:
        want = run_subprocess(model, reqs, timeout=900)
    except Exception as e:  # noqa: BLE001 - the probe's answer is the error
        print("system: the reference failed:", repr(e)[:300])
        return False
    same = [g == w for (g, _), w in zip(got, want)]
    print(f"system: {sum(same)}/{len(same)} image answers token-exact against plain vLLM")
    for i, ((g, _), w) in enumerate(zip(got, want)):
        if g != w:
            print(f"  image request {i}: got {g} want {w}")
    steps_same = [g == want[-1] for g, _ in steps]
    print(f"system: {sum(steps_same)}/{len(steps)} text answers token-exact against plain vLLM")
    return all(same) and all(steps_same)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--system", action="store_true", help="also start vllm-mooncake and check its answers")
    ap.add_argument("--model", default="", help="model dir (default: the bench-light variant)")
    ap.add_argument("--cores", default="", help="cores the system uses, e.g. 0-1 (default: all)")
    ap.add_argument("--lone", action="store_true", help="with --system, first one image request on an idle system")
    args = ap.parse_args()
    if not check_engine():
        return 1
    if args.system:
        from serving import parse_cores

        from services.cli import default_model

        if not check_system(args.model or default_model("bench-light"), parse_cores(args.cores), args.lone):
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
