"""Issue 11 must-show: epd-serve answers OpenAI requests as ``vllm serve`` does.

vLLM's own OpenAI server (``python -m vllm.entrypoints.openai.api_server``) and the
session's epd-serve deployment run the tiny model with the same engine settings and
the same front-end flags (``--enable-auto-tool-choice --tool-call-parser hermes``).
One matrix of requests goes to both, as raw HTTP and through the official ``openai``
client; the answers must agree: status class, texts, token ids, finish reasons,
logprobs (rounded to 2 decimals), usage, tool calls, streamed text and stream usage.
What may differ: ids, timestamps, and the ``epd`` object epd-serve adds.
"""

from __future__ import annotations

import json
import pathlib
import urllib.error
import urllib.request

import psutil
import pytest

from tests import early
from tests.e2e.helpers import VllmServe, metric
from tools.media import data_url, make_image

pytestmark = pytest.mark.e2e

FRONTEND_FLAGS = ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]


_EARLY: list[VllmServe] = []


def start_early(model: str, log_dir: str, prefix: tuple[str, ...] = ()) -> None:
    """Launches this module's ``vllm serve`` ahead of the module (tests/early.py does, at the session's
    start), so that its start overlaps the tests before it."""
    if not _EARLY:
        _EARLY.append(_server(model, pathlib.Path(log_dir) / "server.log", prefix).start())
        early.background(_EARLY[0].proc.pid)


def _server(model: str, log: pathlib.Path, prefix: tuple[str, ...] = ()) -> VllmServe:
    # Stored responses on, as the session deployment's LM has them (tests/e2e/helpers.perturbable).
    return VllmServe(model, log, FRONTEND_FLAGS, env={"VLLM_ENABLE_RESPONSES_API_STORE": "1"}, prefix=prefix)


def stop_early() -> None:
    for server in _EARLY:
        server.stop()


@pytest.fixture(scope="module")
def vllm_serve(tiny_model, tmp_path_factory):
    server = _EARLY[0] if _EARLY else _server(tiny_model, tmp_path_factory.mktemp("vllm-serve") / "server.log").start()
    try:
        url = server.wait_ready()
        early.foreground(psutil.Process(server.proc.pid).children(recursive=True) + [psutil.Process(server.proc.pid)])
        yield url
    finally:
        server.stop()


IMG_A = data_url(make_image(31, (112, 112)))
IMG_B = data_url(make_image(32, (200, 150)))
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


def _image(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def _user(*parts) -> dict:
    return {"role": "user", "content": [p if isinstance(p, dict) else {"type": "text", "text": p} for p in parts]}


CHAT = {
    "image and text": {"messages": [_user(_image(IMG_A), "What is in this picture?")], "max_tokens": 12},
    "multi-turn with system": {"messages": [
        {"role": "system", "content": "You answer briefly."}, _user(_image(IMG_B), "Describe it."),
        {"role": "assistant", "content": "A picture."}, _user("And the colours?")], "max_tokens": 10},
    "several images": {"messages": [_user("Compare", _image(IMG_A), "with", _image(IMG_B))], "max_tokens": 10},
    "same image twice": {"messages": [_user(_image(IMG_A), "and again", _image(IMG_A))], "max_tokens": 10},
    "text only": {"messages": [{"role": "user", "content": "Tell me a story."}], "max_tokens": 12},
    "logprobs": {"messages": [_user(_image(IMG_A), "Hi")], "max_tokens": 6, "logprobs": True, "top_logprobs": 3},
    "seeded n=2": {"messages": [_user(_image(IMG_B), "Go")], "max_tokens": 8, "temperature": 1.0, "seed": 7,
                   "n": 2},
    "penalties": {"messages": [_user("Repeat after me: a a a a")], "max_tokens": 12, "presence_penalty": 0.8,
                  "frequency_penalty": 0.5, "repetition_penalty": 1.3},
    "vllm sampling extras": {"messages": [_user(_image(IMG_A), "Go")], "max_tokens": 10, "temperature": 0.8,
                             "seed": 3, "top_k": 5, "min_p": 0.1, "min_tokens": 6},
    "stop strings": {"messages": [_user("Say something")], "max_tokens": 16, "stop": ["e", "a"]},
    "max_completion_tokens": {"messages": [_user("Say something")], "max_completion_tokens": 5},
    "json_object": {"messages": [_user("Give JSON")], "max_tokens": 20, "response_format": {"type": "json_object"}},
    "json_schema": {"messages": [_user(_image(IMG_A), "Give JSON")], "max_tokens": 30, "response_format": {
        "type": "json_schema", "json_schema": {"name": "answer", "schema": {
            "type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}}}},
    "named tool_choice": {"messages": [_user("Weather in Paris?")], "max_tokens": 30, "tools": TOOLS,
                          "tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
    "auto tool choice": {"messages": [_user(_image(IMG_B), "Weather?")], "max_tokens": 12, "tools": TOOLS,
                         "tool_choice": "auto"},
    "return_token_ids": {"messages": [_user(_image(IMG_A), "Hi")], "max_tokens": 6, "return_token_ids": True},
}
CHAT_STREAM = {
    "stream with usage": {"messages": [_user(_image(IMG_A), "Hi")], "max_tokens": 10,
                          "stream_options": {"include_usage": True}},
    "stream text logprobs": {"messages": [_user("Hi")], "max_tokens": 8, "logprobs": True, "top_logprobs": 2},
    "stream n=2 seeded": {"messages": [_user(_image(IMG_B), "Go")], "max_tokens": 6, "n": 2, "temperature": 1.0,
                          "seed": 11, "stream_options": {"include_usage": True}},
}
COMPLETIONS = {
    "completion logprobs echo": {"prompt": "Once upon a time", "max_tokens": 8, "logprobs": 2, "echo": True},
    "completion seeded n=2": {"prompt": "The sea", "max_tokens": 6, "n": 2, "temperature": 1.0, "seed": 5},
}
COMPLETIONS_STREAM = {
    "completion stream": {"prompt": "Hello", "max_tokens": 8, "stream_options": {"include_usage": True}},
}
BAD = {
    "negative temperature": ("chat", {"messages": [_user("hi")], "temperature": -1}),
    "too many top_logprobs": ("chat", {"messages": [_user("hi")], "logprobs": True, "top_logprobs": 50}),
    "max_tokens beyond the context": ("chat", {"messages": [_user("hi")], "max_tokens": 100000}),
    "unknown model": ("chat", {"messages": [_user("hi")], "model": "no-such-model"}),
    "empty messages": ("chat", {"messages": []}),
    "n=0": ("chat", {"messages": [_user("hi")], "n": 0}),
    "completion without prompt": ("completions", {"max_tokens": 4}),
}

_VOLATILE = {"id", "created", "system_fingerprint", "epd"}


def _normal(x, key: str = ""):
    """A response with what may differ between two servers taken out: ids and timestamps
    (also of tool calls), and floats rounded to 2 decimals."""
    if isinstance(x, dict):
        return {k: _normal(v, k) for k, v in x.items() if k not in _VOLATILE}
    if isinstance(x, list):
        return [_normal(v) for v in x]
    if isinstance(x, float):
        return round(x, 2)
    return x


def _http(url: str, body: dict, timeout: float = 300) -> tuple[int, bytes]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _events(raw: bytes) -> list[dict]:
    out = []
    for line in raw.decode().splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            out.append(json.loads(line[6:]))
    return out


def _stream_summary(events: list[dict], chat: bool) -> dict:
    """A stream as what a client reads from it: per choice its text, tokens' logprobs, finish
    reason; and the usage chunks."""
    choices: dict[int, dict] = {}
    usage = []
    for ev in events:
        if ev.get("usage"):
            usage.append(ev["usage"])
        for c in ev.get("choices") or []:
            s = choices.setdefault(c["index"], {"text": "", "role": None, "finish_reason": None, "logprobs": []})
            if chat:
                delta = c.get("delta") or {}
                s["text"] += delta.get("content") or ""
                s["role"] = s["role"] or delta.get("role")
                if (c.get("logprobs") or {}).get("content"):
                    s["logprobs"] += c["logprobs"]["content"]
            else:
                s["text"] += c.get("text") or ""
                if c.get("logprobs"):
                    s["logprobs"].append(c["logprobs"])
            s["finish_reason"] = c.get("finish_reason") or s["finish_reason"]
    return _normal({"choices": [choices[i] for i in sorted(choices)], "usage": usage})


@pytest.fixture(scope="module")
def servers(vllm_serve, deployment):
    model = json.loads(urllib.request.urlopen(vllm_serve + "/v1/models", timeout=10).read())["data"][0]["id"]
    ours = json.loads(urllib.request.urlopen(deployment.url + "/v1/models", timeout=10).read())["data"][0]["id"]
    assert ours == model  # the same served name
    return {"vllm": vllm_serve, "epd": deployment.url, "model": model}


def _both(servers, path: str, body: dict) -> dict[str, tuple[int, bytes]]:
    # Greedy unless a case samples with a seed: unseeded sampling draws from each engine's own
    # random stream, which two servers with different histories are at different points of.
    body = {"model": servers["model"], "temperature": 0, **body}
    return {name: _http(servers[name] + path, body) for name in ("vllm", "epd")}


@pytest.mark.parametrize("case", list(CHAT))
def test_chat_matches_vllm_serve(servers, case):
    got = _both(servers, "/v1/chat/completions", CHAT[case])
    (sv, bv), (se, be) = got["vllm"], got["epd"]
    assert sv == se == 200, (bv[:500], be[:500])
    want, ours = json.loads(bv), json.loads(be)
    assert "epd" in ours
    assert _normal(ours) == _normal(want)


@pytest.mark.parametrize("case", list(CHAT_STREAM))
def test_chat_stream_matches_vllm_serve(servers, case):
    got = _both(servers, "/v1/chat/completions", dict(CHAT_STREAM[case], stream=True))
    (sv, bv), (se, be) = got["vllm"], got["epd"]
    assert sv == se == 200, (bv[:500], be[:500])
    assert be.rstrip().endswith(b"data: [DONE]") and b"\n: epd " in be
    assert _stream_summary(_events(be), chat=True) == _stream_summary(_events(bv), chat=True)


@pytest.mark.parametrize("case", list(COMPLETIONS))
def test_completion_matches_vllm_serve(servers, case):
    got = _both(servers, "/v1/completions", COMPLETIONS[case])
    (sv, bv), (se, be) = got["vllm"], got["epd"]
    assert sv == se == 200, (bv[:500], be[:500])
    assert _normal(json.loads(be)) == _normal(json.loads(bv))


@pytest.mark.parametrize("case", list(COMPLETIONS_STREAM))
def test_completion_stream_matches_vllm_serve(servers, case):
    got = _both(servers, "/v1/completions", dict(COMPLETIONS_STREAM[case], stream=True))
    (sv, bv), (se, be) = got["vllm"], got["epd"]
    assert sv == se == 200, (bv[:500], be[:500])
    assert _stream_summary(_events(be), chat=False) == _stream_summary(_events(bv), chat=False)


@pytest.mark.parametrize("case", list(BAD))
def test_bad_values_get_the_same_status_class_and_error_type(servers, case):
    api, body = BAD[case]
    got = _both(servers, "/v1/chat/completions" if api == "chat" else "/v1/completions", body)
    (sv, bv), (se, be) = got["vllm"], got["epd"]
    assert sv // 100 == se // 100 == 4, (sv, bv[:300], se, be[:300])
    want, ours = json.loads(bv), json.loads(be)
    assert ours["error"]["type"] == want["error"]["type"], (want, ours)
    assert ours["error"]["message"]


def test_the_openai_client_sees_the_same(servers):
    """The official client, streaming with usage and seeded n=2, against both servers."""
    from openai import OpenAI

    out = {}
    for name in ("vllm", "epd"):
        client = OpenAI(base_url=servers[name] + "/v1", api_key="unused", max_retries=0, timeout=300)
        stream = client.chat.completions.create(
            model=servers["model"], messages=[_user(_image(IMG_A), "Hi")], max_tokens=8, n=2, temperature=1.0,
            seed=21, stream=True, stream_options={"include_usage": True})
        texts, usage = {}, None
        for chunk in stream:
            usage = chunk.usage or usage
            for c in chunk.choices:
                texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
        full = client.chat.completions.create(model=servers["model"], messages=[_user(_image(IMG_B), "Go")],
                                              max_tokens=8, logprobs=True, top_logprobs=2, temperature=0)
        out[name] = (texts, usage.model_dump() if usage else None, full.choices[0].message.content,
                     [round(t.logprob, 2) for t in full.choices[0].logprobs.content])
    assert out["epd"] == out["vllm"]


# Issue 22: the rest of `vllm serve`'s generative surface, answered by vLLM's own app on the LM.
_VOLATILE_MORE = {"created_at", "completed_at"}


def _norm(x, key: str = ""):
    if isinstance(x, dict):
        return {k: _norm(v, k) for k, v in x.items() if k not in _VOLATILE | _VOLATILE_MORE}
    if isinstance(x, list):
        return [_norm(v) for v in x]
    if isinstance(x, float):
        return round(x, 2)
    if isinstance(x, str) and x.startswith(("resp_", "msg_", "chatcmpl-", "call_", "fc_", "rs_")):
        return x.split("_")[0]  # an id inside a text field (item ids in events)
    return x


def _sse(raw: bytes) -> list[tuple[str, dict]]:
    """A stream's events as (event name, data), epd's ``: epd`` comment left out."""
    out, name = [], ""
    for line in raw.decode().splitlines():
        if line.startswith("event: "):
            name = line[7:]
        elif line.startswith("data: ") and line != "data: [DONE]":
            out.append((name, json.loads(line[6:])))
            name = ""
    return out


def _collapsed(events: list[tuple[str, dict]]) -> list:
    """A stream as a client reads it: runs of text deltas joined into one (how a server splits its
    text into deltas depends on timing, in ``vllm serve`` too), sequence numbers dropped."""
    out: list = []
    for name, data in events:
        data = {k: v for k, v in data.items() if k != "sequence_number"}
        if name == "response.output_text.delta" or (name == "content_block_delta" and "text" in data["delta"]):
            text = data["delta"] if name.startswith("response.") else data["delta"]["text"]
            if out and out[-1][0] == name:
                out[-1][1] += text
                continue
            out.append([name, text])
        else:
            out.append([name, _norm(data)])
    return out


def _diff(a, b, path: str = "") -> list[str]:
    """Where two JSON values differ (paths, for an assertion's message)."""
    if isinstance(a, dict) and isinstance(b, dict):
        return [d for k in sorted(set(a) | set(b), key=str) for d in _diff(a.get(k), b.get(k), f"{path}.{k}")]
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in _diff(x, y, f"{path}[{i}]")]
    return [] if a == b else [f"{path}: {str(a)[:120]} != {str(b)[:120]}"]


def _b64(url: str) -> str:
    return url.split(",", 1)[1]


def _input_image(url: str) -> dict:
    return {"type": "input_image", "image_url": url}


def _anthropic_image(url: str) -> dict:
    return {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": _b64(url)}}


RESPONSES = {
    "text": {"input": "Tell me a story.", "max_output_tokens": 10},
    "image": {"input": [{"role": "user", "content": [_input_image(IMG_A), {"type": "input_text",
                                                                           "text": "What is it?"}]}],
              "max_output_tokens": 10},
    "two images and instructions": {"instructions": "Answer briefly.", "input": [{"role": "user", "content": [
        _input_image(IMG_B), {"type": "input_text", "text": "and"}, _input_image(IMG_A)]}], "max_output_tokens": 8},
    "tool call": {"input": "Weather in Paris?", "max_output_tokens": 30, "tool_choice": {
        "type": "function", "name": "get_weather"}, "tools": [dict(TOOLS[0]["function"], type="function")]},
    # A tool's output image beside an ordinary one: the gateway reads both (vLLM makes the output a tool
    # message's content), so both are encoded on the encoder and checked like any other.
    "tool output image": {"max_output_tokens": 8, "tools": [dict(TOOLS[0]["function"], type="function")], "input": [
        {"role": "user", "content": [_input_image(IMG_B), {"type": "input_text", "text": "Weather here?"}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": [
            {"type": "input_text", "text": "The sky:"}, dict(_input_image(IMG_A), detail="auto")]}]},
}
MESSAGES = {
    "image as base64": {"max_tokens": 10, "messages": [{"role": "user", "content": [
        _anthropic_image(IMG_A), {"type": "text", "text": "What is it?"}]}]},
    "system prompt": {"max_tokens": 10, "system": "You answer briefly.", "messages": [
        {"role": "user", "content": [_anthropic_image(IMG_B), {"type": "text", "text": "Describe it."}]}]},
    "text": {"max_tokens": 10, "messages": [{"role": "user", "content": "Hello there"}]},
    "tool use": {"max_tokens": 30, "tools": [{"name": "get_weather", "description": "Weather in a city",
                                              "input_schema": TOOLS[0]["function"]["parameters"]}],
                 "tool_choice": {"type": "tool", "name": "get_weather"},
                 "messages": [{"role": "user", "content": "Weather in Paris?"}]},
}
SURFACE_BAD = {
    "responses: unknown model": ("/v1/responses", {"input": "hi", "model": "no-such-model"}),
    "responses: bad parameter": ("/v1/responses", {"input": "hi", "temperature": -3}),
    "messages: no max_tokens": ("/v1/messages", {"messages": [{"role": "user", "content": "hi"}]}),
    "messages: unknown model": ("/v1/messages", {"max_tokens": 4, "model": "no-such-model",
                                                 "messages": [{"role": "user", "content": "hi"}]}),
    "tokenize: neither prompt nor messages": ("/tokenize", {}),
    "detokenize: a token past the vocabulary": ("/detokenize", {"tokens": [10 ** 9]}),
}


def _local_runs(deployment) -> float:
    from tests.e2e.helpers import metric

    return metric(deployment.lm_metrics, "epd_lm_local_encoder_runs_total")


@pytest.mark.parametrize("path,case", [("/v1/responses", c) for c in RESPONSES] +
                         [("/v1/messages", c) for c in MESSAGES])
def test_responses_and_messages_match_vllm_serve(servers, deployment, path, case):
    local = _local_runs(deployment)
    got = _both(servers, path, (RESPONSES if path == "/v1/responses" else MESSAGES)[case])
    (sv, bv), (se, be) = got["vllm"], got["epd"]
    assert sv == se == 200, (bv[:500], be[:500])
    assert _norm(json.loads(be)) == _norm(json.loads(bv))
    assert _local_runs(deployment) == local  # the images went through the encoder


@pytest.mark.parametrize("path,body", [
    ("/v1/responses", RESPONSES["image"]), ("/v1/messages", MESSAGES["image as base64"])], ids=["responses", "messages"])
def test_streams_match_vllm_serve_event_by_event(servers, path, body):
    got = _both(servers, path, dict(body, stream=True))
    (sv, bv), (se, be) = got["vllm"], got["epd"]
    assert sv == se == 200, (bv[:500], be[:500])
    ours, want = _collapsed(_sse(be)), _collapsed(_sse(bv))
    assert ours == want, _diff(ours, want)  # the same events, the same text
    assert b"data: [DONE]" not in be  # these APIs end with their own last event


@pytest.mark.parametrize("path,body", [
    ("/tokenize", {"prompt": "Hello world, again"}),
    ("/tokenize", {"messages": [_user(_image(IMG_A), "What is it?", _image(IMG_B))]}),
    ("/tokenize", {"messages": [_user("Hi")], "add_generation_prompt": True, "return_token_strs": True}),
    ("/detokenize", {"tokens": [10, 11, 12, 300]}),
    ("/v1/messages/count_tokens", {"messages": [{"role": "user", "content": [
        _anthropic_image(IMG_A), {"type": "text", "text": "Count me"}]}]}),
], ids=["tokenize text", "tokenize chat with images", "tokenize token strs", "detokenize", "count_tokens"])
def test_token_endpoints_match_vllm_serve(servers, deployment, path, body):
    from tests.e2e.helpers import encodes_done, metric

    encodes_done(deployment)  # an earlier test's vision run is counted before the baseline, not after it
    runs = metric(deployment.encoder_metrics, "epd_encoder_vision_runs_total")
    local = _local_runs(deployment)
    got = _both(servers, path, body)
    (sv, bv), (se, be) = got["vllm"], got["epd"]
    assert sv == se == 200, (bv[:500], be[:500])
    assert _norm(json.loads(be)) == _norm(json.loads(bv))
    # Counting lays the prompt out (the LM's processor); no vision tower runs anywhere.
    assert metric(deployment.encoder_metrics, "epd_encoder_vision_runs_total") == runs
    assert _local_runs(deployment) == local


@pytest.mark.parametrize("case", list(SURFACE_BAD))
def test_surface_errors_match_vllm_serve(servers, case):
    path, body = SURFACE_BAD[case]
    got = _both(servers, path, body)
    (sv, bv), (se, be) = got["vllm"], got["epd"]
    assert sv == se, (sv, bv[:300], se, be[:300])
    assert _norm(json.loads(be)) == _norm(json.loads(bv))


def _image_work(dep) -> dict[str, float]:
    """The deployment's vision runs (encoder and LM), transfers and prefix-cache hits so far."""
    return {"encoder": metric(dep.encoder_metrics, "epd_encoder_vision_runs_total"),
            "local": metric(dep.lm_metrics, "epd_lm_local_encoder_runs_total"),
            "transferred": metric(dep.lm_metrics, "epd_lm_transferred_items_total"),
            "hits": metric(dep.lm_metrics, "vllm:prefix_cache_hits_total")}


def _get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=60) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def test_stored_responses_and_previous_response_id_match_vllm_serve(servers, deployment):
    """With VLLM_ENABLE_RESPONSES_API_STORE=1 on both: a follow-up naming the first response, the
    stored response fetched by id, and an unknown id. The follow-up's image (vLLM renders the stored
    input again) is neither encoded again nor transferred: the LM holds it under the same identifier (the
    first turn is long enough, about 200 tokens, to fill a KV block: its prefix cache has it; issue 33)."""
    dep = deployment
    first = _both(servers, "/v1/responses", {"input": [{"role": "user", "content": [
        _input_image(IMG_A), {"type": "input_text", "text": "Remember this picture. "
                                                + "Describe every shape and colour in it. " * 20}]}],
                                                "max_output_tokens": 6})
    ids = {name: json.loads(body)["id"] for name, (status, body) in first.items()}
    before = _image_work(dep)
    follow = {name: _http(servers[name] + "/v1/responses", {
        "model": servers["model"], "temperature": 0, "input": "What was in it?", "max_output_tokens": 6,
        "previous_response_id": ids[name]}) for name in ("vllm", "epd")}
    (sv, bv), (se, be) = follow["vllm"], follow["epd"]
    assert sv == se == 200, (bv[:500], be[:500])
    assert _norm(json.loads(be)) == _norm(json.loads(bv))
    after = _image_work(dep)
    assert after["hits"] > before["hits"], (before, after)  # the first turn's blocks, image included
    assert {k: after[k] - before[k] for k in ("encoder", "local", "transferred")} == \
        {"encoder": 0, "local": 0, "transferred": 0}, (before, after)
    stored = {name: _get(servers[name] + "/v1/responses/" + ids[name]) for name in ("vllm", "epd")}
    assert stored["vllm"][0] == stored["epd"][0] == 200
    assert _norm(json.loads(stored["epd"][1])) == _norm(json.loads(stored["vllm"][1]))
    missing = {name: _get(servers[name] + "/v1/responses/resp_unknown") for name in ("vllm", "epd")}
    assert missing["vllm"][0] == missing["epd"][0] and missing["vllm"][0] >= 400
    assert _norm(json.loads(missing["epd"][1])) == _norm(json.loads(missing["vllm"][1]))


@pytest.mark.parametrize("path", ["/v1/chat/completions/render", "/v1/responses/render", "/inference/v1/generate"])
def test_scale_out_routes_answer_as_vllm_serve_without_scale_out(servers, path):
    got = _both(servers, path, {"messages": [_user("hi")]})
    (sv, bv), (se, be) = got["vllm"], got["epd"]
    assert sv == se == 403, (bv[:300], be[:300])
    assert _norm(json.loads(be)) == _norm(json.loads(bv))


def test_probes_match_vllm_serve(servers):
    for path in ("/version", "/ping"):
        with urllib.request.urlopen(servers["vllm"] + path, timeout=10) as r:
            want = (r.status, r.read())
        with urllib.request.urlopen(servers["epd"] + path, timeout=10) as r:
            ours = (r.status, r.read())
        if path == "/version":
            assert _norm(json.loads(ours[1])) == _norm(json.loads(want[1]))
        else:
            assert ours == want
