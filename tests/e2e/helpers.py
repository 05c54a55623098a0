"""Request builders and metric readers for the e2e tests (one place)."""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request

from epd.transfer.v1 import transfer_pb2, transfer_pb2_grpc
from services.common.engine import EngineConfig
from services.common.spawn import child_env
from services.up import free_port
from tools.media import data_url, make_image

TEARDOWN_DRAIN_S = 0.0
"""The suite's deployments' ``--drain-grace-s``: none of their tests asks an instance to drain, and at
teardown ``Deployment.stop`` stops the gateway first, so the quiet period an instance waits for calls
still on their way (``services.common.drain.QUIET_S``, 2 s a deployment) is waiting for nothing. The
drain itself is tested where it is the subject (tests/unit/test_autoscale_fleet.py; tests/e2e/test_elastic.py, slow)."""


def perturb_chat(seed: int) -> dict:
    """A request for the perturbation check: a 224x224 image, 12 greedy tokens."""
    return {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_url(make_image(seed, (224, 224)))}},
        {"type": "text", "text": "Describe the picture."}]}],
        "max_tokens": 12, "temperature": 0, "return_token_ids": True}


def image_chat(seed: int, text: str = "What is in this picture?", max_tokens: int = 12,
               size: tuple[int, int] = (112, 112)) -> dict:
    return {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_url(make_image(seed, size))}},
        {"type": "text", "text": text}]}], "max_tokens": max_tokens, "temperature": 0,
            "return_token_ids": True}


def images_chat(images: list[tuple[int, tuple[int, int]]], text: str = "Compare these pictures.",
                max_tokens: int = 12) -> dict:
    """A chat with several images, ``(seed, size)`` each, before one question."""
    return {"messages": [{"role": "user", "content": [
        *({"type": "image_url", "image_url": {"url": data_url(make_image(seed, size))}} for seed, size in images),
        {"type": "text", "text": text}]}], "max_tokens": max_tokens, "temperature": 0, "return_token_ids": True}


def conversation(seed: int, turns: int, max_tokens: int = 8) -> list[dict]:
    """The bodies of a chat's first ``turns`` turns, each re-sending the history as clients do: turn 0
    asks about an image; each later turn adds a fixed assistant answer (the same for plain vLLM and for
    epd-serve) and another question. The first question is long enough (about 200 tokens with the image)
    that the first turn fills a whole KV block (128 tokens on vLLM's CPU backend): a later turn can find
    that block, image included, in the prefix cache."""
    first = {"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_url(make_image(seed, (224, 224)))}},
        {"type": "text", "text": "What is in this picture? " + "Describe every shape and colour in it. " * 20}]}
    return _turns(first, turns, max_tokens, "about shapes and colours.", "Tell me more, point {t}.")


def text_conversation(turns: int, max_tokens: int = 8) -> list[dict]:
    """``conversation``'s turns without an image: a first question of about 300 tokens (two whole KV blocks
    on vLLM's CPU backend), then fixed answers and short questions."""
    first = {"role": "user", "content": "Tell me about the sea. " + "Waves, tides and salt. " * 50}
    return _turns(first, turns, max_tokens, "about the sea.", "And point {t}?")


def _turns(first: dict, turns: int, max_tokens: int, about: str, question: str) -> list[dict]:
    """Turn t's body: ``first``, then per earlier turn the answer "Answer number t, ``about``" and ``question``."""
    messages, bodies = [first], []
    for t in range(turns):
        if t:
            messages = [*messages, {"role": "assistant", "content": f"Answer number {t}, {about}"},
                        {"role": "user", "content": question.format(t=t)}]
        bodies.append({"messages": messages, "max_tokens": max_tokens, "temperature": 0, "return_token_ids": True})
    return bodies


def image_bytes(body: dict) -> bytes:
    """The first image of a chat body built by ``image_chat``."""
    import base64

    for m in body["messages"]:
        for part in m["content"] if isinstance(m["content"], list) else []:
            if part.get("type") == "image_url":
                return base64.b64decode(part["image_url"]["url"].split(",", 1)[1])
    raise ValueError("no image in this request")


def text_chat(text: str, max_tokens: int = 12) -> dict:
    return {"messages": [{"role": "user", "content": text}], "max_tokens": max_tokens, "temperature": 0,
            "return_token_ids": True}


def post(url: str, body: bytes | dict, timeout: float = 120) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def metric(port: int, name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` on a Prometheus endpoint whose labels
    include ``labels`` (all label sets when none are given)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
        text = r.read().decode()
    total = 0.0
    for line in text.splitlines():
        m = re.match(rf"^{re.escape(name)}(?:{{([^}}]*)}})? ([0-9.eE+-]+)$", line)
        if m and all(f'{k}="{v}"' in (m.group(1) or "") for k, v in labels.items()):
            total += float(m.group(2))
    return total


def settled(read, want, timeout: float = 30.0):
    """``read()`` once it equals ``want``, or its last value after ``timeout``
    (assert on it). For counters that trail an answer: the LM can answer
    before the encoder's Encode handler has resumed to count its work."""
    deadline = time.monotonic() + timeout
    while (value := read()) != want and time.monotonic() < deadline:
        time.sleep(0.05)
    return value


def encodes_done(dep, timeout: float = 60.0) -> None:
    """Returns once ``dep``'s gateway has no Encode call in flight. An encoder counts an Encode's work
    (``epd_encoder_vision_runs_total``, ``epd_encoder_requests_total``) before its last events, which
    can reach the gateway after the LM answered: read an encoder counter's baseline after this, or a
    previous request's count may land between the baseline and the check."""
    settled(lambda: metric(dep.gateway_metrics, "epd_gateway_instance_outstanding", role="encoder"), 0.0, timeout)


def wait_admitted(port: int, encoders: list[str], lms: list[str], timeout: float = 120.0) -> None:
    """Waits until the gateway whose HTTP port is ``port`` has admitted each of these encoder and LM
    addresses, as ``Deployment.start`` does for its own gateway (``services.up.gateway_admitted``): for a
    gateway a test starts itself, whose /health is 200 once one LM is admitted."""
    from services.up import gateway_admitted

    deadline = time.monotonic() + timeout
    while not gateway_admitted(f"http://127.0.0.1:{port}", encoders, lms):
        assert time.monotonic() < deadline, f"gateway on port {port} has not admitted {encoders + lms} in {timeout:.0f}s"
        time.sleep(0.1)


def producer_stats(dep, address: str | None = None) -> dict[str, float]:
    """Live outbound-pool numbers of a deployment's encoder (TransferService.Stats): the one at
    ``address``, default its first."""
    from epd.encoder.v1 import encoder_pb2, encoder_pb2_grpc

    with dep.client_security.channel(address or dep.encoder_addr) as ch:
        info = encoder_pb2_grpc.EncoderServiceStub(ch).GetInfo(encoder_pb2.GetInfoRequest(), timeout=30)
    with dep.client_security.channel(info.transfer_endpoint) as ch:
        return dict(transfer_pb2_grpc.TransferServiceStub(ch).Stats(transfer_pb2.StatsRequest(), timeout=30).values)


PERTURB_HOOK_DIR = os.path.join(os.path.dirname(__file__), "perturb")


def perturbable(dep):
    """``dep`` (a ``Deployment``, not started) with the test-only hooks loaded in its services
    (``tests/e2e/perturb/sitecustomize.py``: the perturbation, and a slow item), switched off. The hooks'
    variables go to the services alone (``dep.env``), never to this process's environment."""
    dep.env.update({
        "PYTHONPATH": os.pathsep.join(p for p in (PERTURB_HOOK_DIR, os.environ.get("PYTHONPATH")) if p),
        "EPD_TEST_PERTURB_SWITCH": os.path.join(dep.log_dir, "perturb-on"),
        "EPD_TEST_PERTURB_LOG": os.path.join(dep.log_dir, "perturbed.txt"),
        "EPD_TEST_DELAY_SWITCH": os.path.join(dep.log_dir, "delay-on"),  # tests/e2e/test_prefill_in_step.py
        # Stored responses on, as tests/e2e/test_openai_parity.py gives `vllm serve` (previous_response_id).
        "VLLM_ENABLE_RESPONSES_API_STORE": "1",
    })
    return dep


LATE_INDEX = 1  # the second output of the encoder's step: the second item
LATE_S = 3.0


@contextlib.contextmanager
def late_items(dep, index: int = LATE_INDEX, seconds: float = LATE_S):
    """While in it, ``dep``'s encoder reports the ``index``-th output of each engine step ``seconds`` late
    (the hook ``perturbable`` loads; tests/e2e/test_prefill_in_step.py, test_families.py)."""
    switch = os.path.join(dep.log_dir, "delay-on")
    with open(switch, "w") as f:
        f.write(f"{index} {seconds}")
    try:
        yield
    finally:
        os.unlink(switch)


def check_perturbation_changes_tokens(dep, bodies: list[dict], reference: list[list[int]]) -> None:
    """With the hook on, every embedding the LM injects is negated and scaled: the requests still
    succeed, each image went through the hook, nothing was encoded on the LM, and the greedy tokens
    are no longer plain vLLM's (``reference``). The hook is off again afterwards."""
    switch = os.path.join(dep.log_dir, "perturb-on")
    log = os.path.join(dep.log_dir, "perturbed.txt")
    before = open(log).read().split() if os.path.exists(log) else []
    lm_runs = metric(dep.lm_metrics, "epd_lm_local_encoder_runs_total")
    open(switch, "w").close()
    try:
        results = [post(dep.url + "/v1/chat/completions", b, 120) for b in bodies]
    finally:
        os.remove(switch)
    assert all(status == 200 for status, _ in results), results
    assert metric(dep.lm_metrics, "epd_lm_local_encoder_runs_total") == lm_runs  # every image transferred
    perturbed = open(log).read().split()[len(before):]
    assert len(set(perturbed)) == len(bodies), perturbed  # each image's embedding went through the hook
    got = [body["choices"][0]["token_ids"] for _, body in results]
    assert all(g != r for g, r in zip(got, reference)), (got, reference)


def engine_flags(model: str) -> list[str]:
    """The flags that give ``vllm serve`` the engine ``EngineConfig``'s defaults give the services
    (``services.common.engine.engine_kwargs``)."""
    e = EngineConfig(model=model)
    flags = ["--model", model, "--dtype", e.dtype, "--max-num-seqs", str(e.max_num_seqs), "--seed", str(e.seed),
             "--kv-cache-memory-bytes", str(e.kv_cache_bytes),
             "--limit-mm-per-prompt", json.dumps({"image": e.max_images_per_prompt, "audio": e.max_audios_per_prompt,
                                                  "video": e.max_videos_per_prompt})]
    return flags + (["--enforce-eager"] if e.enforce_eager else [])


class VllmServe:
    """``vllm serve`` (vLLM's own OpenAI server) on ``model`` with the services' engine settings plus
    ``flags``, on a free loopback port. ``start`` launches it without waiting; ``wait_ready`` returns its
    URL once /health answers; ``stop`` ends it. ``prefix``: a command to run it under (``nice -n 10``)."""

    def __init__(self, model: str, log: pathlib.Path, flags: list[str] = (), env: dict[str, str] | None = None,
                 prefix: tuple[str, ...] = ()):
        self.model, self.log, self.flags, self.env = model, log, list(flags), dict(env or {})
        self.prefix = list(prefix)
        self.proc: subprocess.Popen | None = None
        self.url = ""

    def start(self) -> VllmServe:
        port = free_port()
        env = dict(child_env(), HF_HUB_OFFLINE="1",
                   TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1",
                   VLLM_WORKER_MULTIPROC_METHOD="spawn", **self.env)
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen([*self.prefix, sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--host",
                                          "127.0.0.1", "--port", str(port), *engine_flags(self.model), *self.flags],
                                         stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        self.url = f"http://127.0.0.1:{port}"
        return self

    def wait_ready(self, timeout: float = 300) -> str:
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited:\n{self.log.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return self.url
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"vllm serve not ready:\n{self.log.read_text()[-3000:]}")
            time.sleep(0.5)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@contextlib.contextmanager
def vllm_serve(model: str, log: pathlib.Path, flags: list[str] = (), env: dict[str, str] | None = None,
               timeout: float = 300):
    """``VllmServe`` as a context: yields its URL once ready; stopped on exit."""
    server = VllmServe(model, log, flags, env).start()
    try:
        yield server.wait_ready(timeout)
    finally:
        server.stop()
