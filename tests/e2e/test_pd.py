"""E -> P -> D through ``epd up --prefills 1 --decodes 1``: an encoder, a prefill LM and a decode LM
(vLLM's NixlConnector moving the prompt's KV, UCX on this host) behind the gateway, against plain
vLLM's ``LLM.chat`` on the same requests.

One deployment for the module. Its LMs run a chat template that ends the prompt with the last message
(no end-of-utterance, no generation prompt), so a user message that ends with an image makes a prompt
that ends inside the image's placeholder: the decode LM's recompute of the last prompt token then needs
that image's embedding, and reads it under its own claim on the encoder's copy.
"""

from __future__ import annotations

import base64
import json
import os
import signal
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
import msgspec
import pytest

from epd.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from epd.lm.v1 import lm_pb2, lm_pb2_grpc
from services.up import Deployment
from tests.e2e.conftest import stop_in_background
from tests.e2e.helpers import TEARDOWN_DRAIN_S, image_chat, metric, post, producer_stats, settled, text_chat
from tools.media import data_url, make_image
from tools.reference import run_subprocess

# slow (make test-all): on a 2-core host the prefill and decode engines' NIXL progress threads busy-poll
# both cores (docs/design.md, "Prefill and decode tiers"), which starves the rest of the suite and made
# this module fail under load. The gateway's and the LM's halves run in the default run without NIXL
# (tests/integration/test_gateway_pd.py, tests/unit/test_lm_kv_handoff.py).
pytestmark = [pytest.mark.e2e, pytest.mark.slow]

TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{ message['role'] | capitalize }}"
    "{% if message['content'] is string %}{{ ': ' + message['content'] }}{% else %}"
    "{% if message['content'] and message['content'][0]['type'] in ('image', 'image_url') %}{{ ':' }}"
    "{% else %}{{ ': ' }}{% endif %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}{% elif part['type'] in ('image', 'image_url') %}"
    "{{ '<image>' }}{% endif %}{% endfor %}{% endif %}{% if not loop.last %}<end_of_utterance>\n{% endif %}"
    "{% endfor %}")
"""The tiny model's template, less what follows the last message."""



def _image_part(seed: int, size=(112, 112)) -> dict:
    return {"type": "image_url", "image_url": {"url": data_url(make_image(seed, size))}}


def _two_images() -> dict:
    return {"messages": [{"role": "user", "content": [_image_part(3100), {"type": "text", "text": "and"},
                                                      _image_part(3101, (150, 120)), {"type": "text",
                                                                                      "text": "compare"}]}],
            "max_tokens": 10, "temperature": 0, "return_token_ids": True}


def _image_last() -> dict:
    return {"messages": [{"role": "user", "content": [{"type": "text", "text": "Look:"}, _image_part(3200)]}],
            "max_tokens": 10, "temperature": 0, "return_token_ids": True}


REQUESTS = {
    "text": text_chat("Tell me a story about a dog."),
    "image": image_chat(3000),
    "two images": _two_images(),
    "ends with an image": _image_last(),
    "stream": {**image_chat(3300), "stream": True, "stream_options": {"include_usage": True}},
    "logprobs": {**text_chat("Name a colour."), "logprobs": True, "top_logprobs": 2},
    "seeded n=2": {**image_chat(3400), "temperature": 0.8, "seed": 11, "n": 2},
    "kv counts": image_chat(3500, text="Count the KV."),
    "completion": {"prompt": "Once upon a time", "max_tokens": 10, "temperature": 0, "return_token_ids": True},
}


@pytest.fixture(scope="module")
def pd(tiny_model, tmp_path_factory):
    template = tmp_path_factory.mktemp("pd") / "template.jinja"
    template.write_text(TEMPLATE)
    bodies = [{k: v for k, v in b.items() if k not in ("stream", "stream_options")} | {"chat_template": TEMPLATE}
              for b in REQUESTS.values()]
    with ThreadPoolExecutor(1) as pool:
        reference = pool.submit(run_subprocess, tiny_model, bodies)
        dep = Deployment(model=tiny_model, quiet=True, drain_grace_s=TEARDOWN_DRAIN_S, n_lms=0, n_prefills=1, n_decodes=1,
                         lm_args=["--chat-template", str(template)])
        try:
            dep.start()
            yield dep, dict(zip(REQUESTS, reference.result()))
        finally:
            stop_in_background(dep)


def _chat(dep: Deployment, body: dict) -> dict:
    status, out = post(dep.url + "/v1/chat/completions", body, timeout=120)
    assert status == 200, out
    return out


def _lms(dep: Deployment):
    by = {s.name: s for s in dep.lms}
    return by["prefill"], by["decode"]


def assert_prefilled_then_decoded(dep: Deployment, out: dict, want: list[int]) -> dict:
    """``out`` (a chat answer) has plain vLLM's tokens, was prefilled on the prefill LM and decoded on the
    decode LM at the first try, and nothing was encoded on either; its facts are returned."""
    assert out["choices"][0]["token_ids"] == want
    facts = out["epd"]
    p, d = _lms(dep)
    assert facts["prefill_lm"] == p.address and facts["lm"] == d.address, facts
    assert facts["retries"] == 0 and facts["local_encoder_runs"] == 0, facts
    return facts


@pytest.mark.parametrize("name", ["text", "image", "two images", "ends with an image"])
def test_greedy_tokens_equal_plain_vllm(pd, name):
    dep, ref = pd
    out = _chat(dep, REQUESTS[name])
    facts = assert_prefilled_then_decoded(dep, out, ref[name])
    if name == "ends with an image":
        # The prompt ends with the image's closing token (the template adds nothing after the last
        # message): the decode LM recomputes that token over the KV it loaded. It is inside the image's
        # placeholder but no embedding row (Idefics3 wraps each image), so the decode LM needs no
        # embedding and lets its claim go, as vLLM's scheduler decides.
        assert facts["transferred_items"] == 0, facts
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(dep.model)
        assert tok.convert_ids_to_tokens(out["prompt_token_ids"][-2:]) == ["<image>", "<fake_token_around_image>"]
    # Every copy the encoder made was read by the prefill LM and read or let go by the decode LM (its
    # claim cancelled where the loaded KV covers the image): nothing stays in the encoder's pool.
    deadline = time.monotonic() + 60
    while (stats := producer_stats(dep))["items_held"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert stats["items_held"] == 0 and stats["expired"] == 0, stats


def _chat_events(dep: Deployment, body: dict):
    """The events of a streamed chat, as the gateway sends them (``[DONE]`` left out)."""
    req = urllib.request.Request(dep.url + "/v1/chat/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        for line in r:
            line = line.decode().strip()
            if line.startswith("data: ") and line != "data: [DONE]":
                yield json.loads(line[6:])


def _stream_tokens(dep: Deployment, body: dict) -> list[int]:
    """A streamed chat's tokens; its usage (the last event's) must count them."""
    tokens, usage = [], None
    for event in _chat_events(dep, body):
        for c in event.get("choices", []):
            tokens += c.get("token_ids") or []
        usage = event.get("usage") or usage
    assert usage["completion_tokens"] == len(tokens), usage
    return tokens


def assert_logprobs_equal(out: dict, ref: dict) -> None:
    """A chat answer's tokens and top logprobs (to 2 places) are plain vLLM's."""
    (want,) = ref["choices"]
    choice = out["choices"][0]
    assert choice["token_ids"] == want["tokens"]
    got = [round(t["logprob"], 2) for t in choice["logprobs"]["content"]]
    assert got == [round(x, 2) for x in want["logprobs"]]


def assert_choices_equal(out: dict, ref: dict) -> None:
    """A chat answer's n choices, in index order, have plain vLLM's tokens."""
    got = sorted((c["index"], c["token_ids"]) for c in out["choices"])
    assert [t for _, t in got] == [c["tokens"] for c in ref["choices"]]


def test_streaming_with_usage_equals_plain_vllm(pd):
    dep, ref = pd
    assert _stream_tokens(dep, REQUESTS["stream"]) == ref["stream"]


def test_logprobs_equal_plain_vllm(pd):
    dep, ref = pd
    assert_logprobs_equal(_chat(dep, REQUESTS["logprobs"]), ref["logprobs"])


def test_seeded_n2_equals_plain_vllm(pd):
    dep, ref = pd
    assert_choices_equal(_chat(dep, REQUESTS["seeded n=2"]), ref["seeded n=2"])


def _prompt_tokens(lm, source: str) -> float:
    """vLLM's own count of the prompt tokens an engine took from ``source`` (its Prometheus metrics, on the
    LM's metrics port)."""
    return metric(lm.metrics_port, "vllm:prompt_tokens_by_source_total", source=source)


def _handoffs(lm, phase: str, outcome: str) -> float:
    return metric(lm.metrics_port, "epd_lm_kv_handoffs_total", phase=phase, outcome=outcome)


def test_decode_lm_loads_the_prompt_kv_and_nothing_is_encoded_on_p_or_d(pd):
    dep, ref = pd
    p, d = _lms(dep)
    sources = ("local_compute", "external_kv_transfer")
    before = {lm.name: {s: _prompt_tokens(lm, s) for s in sources} for lm in (p, d)}
    handoffs = _handoffs(p, "prefill", "ok"), _handoffs(d, "decode", "ok")
    out = _chat(dep, REQUESTS["kv counts"])
    # Counted as each call ends, which can trail the gateway's answer.
    assert settled(lambda: (_handoffs(p, "prefill", "ok"), _handoffs(d, "decode", "ok")),
                   (handoffs[0] + 1, handoffs[1] + 1)) == (handoffs[0] + 1, handoffs[1] + 1)
    assert out["choices"][0]["token_ids"] == ref["kv counts"]
    n_prompt = out["usage"]["prompt_tokens"]
    delta = {lm.name: {s: _prompt_tokens(lm, s) - before[lm.name][s] for s in sources} for lm in (p, d)}
    # The prefill LM computed the prompt; the decode LM loaded all of it (vLLM counts the whole prompt as
    # transferred; it recomputes the last token only for the first logits) and computed none of it.
    assert delta["prefill"] == {"local_compute": n_prompt, "external_kv_transfer": 0}, delta
    assert delta["decode"] == {"local_compute": 0, "external_kv_transfer": n_prompt}, delta
    for lm in (p, d):
        assert metric(lm.metrics_port, "epd_lm_local_encoder_runs_total") == 0, lm.name


def test_a_callers_kv_transfer_params_are_ignored(pd):
    """A caller's kv_transfer_params (in the body or in vllm_xargs) would make the decode LM dial what
    the caller chose: both are dropped, and the answer is the one without them."""
    dep, ref = pd
    bogus = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "x",
             "remote_block_ids": [0, 1], "remote_host": "10.255.255.1", "remote_port": 9,
             "remote_request_id": "x"}
    for extra in ({"kv_transfer_params": bogus}, {"vllm_xargs": {"kv_transfer_params": json.dumps(bogus)}}):
        out = _chat(dep, {**REQUESTS["text"], **extra})
        assert out["choices"][0]["token_ids"] == ref["text"], extra
        assert out.get("kv_transfer_params") is None


def test_malformed_frames_on_the_prefill_lms_side_channel_leave_it_answering_handshakes_and_pairing(pd):
    """The prefill engine's NIXL listener is ours (services.lm.nixl_connector): malformed messages of
    several shapes are dropped, the next handshake on the same connection gets the engine's real payload,
    and requests still go E -> P -> D."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import NixlHandshakePayload

    from tests.integration.nixl_peer import MALFORMED, dealer, request

    dep, ref = pd
    p, _ = _lms(dep)
    kv_port = int(p.args[p.args.index("--kv-port") + 1])
    with dealer("127.0.0.1", kv_port) as peer:
        for frames in MALFORMED.values():
            peer.send_multipart(frames)
        peer.send_multipart([b"", request()])
        reply = peer.recv_multipart()
    payload = msgspec.msgpack.Decoder(NixlHandshakePayload).decode(reply[1])  # as a decode engine reads it
    assert payload.compatibility_hash and payload.agent_metadata_bytes
    assert_prefilled_then_decoded(dep, _chat(dep, REQUESTS["image"]), ref["image"])


def test_the_other_generating_apis_go_e_p_d_and_tokenize_goes_to_one_lm(pd):
    """Messages and Responses go prefill then decode like chat (the same prompt, so plain vLLM's chat
    tokens, as text); tokenize is answered by one LM (nothing to hand over)."""
    from transformers import AutoTokenizer

    dep, ref = pd
    want = AutoTokenizer.from_pretrained(dep.model).decode(ref["text"], skip_special_tokens=True)
    text = REQUESTS["text"]["messages"][0]["content"]
    status, msg = post(dep.url + "/v1/messages", {"model": dep.model, "max_tokens": 12, "temperature": 0,
                                                  "messages": [{"role": "user", "content": text}]}, timeout=120)
    # As text: a token that ends inside a UTF-8 character is left out of an answer's text by one API
    # and kept as U+FFFD by the tokenizer's decode.
    want = want.rstrip("\ufffd")
    assert status == 200 and msg["content"][0]["text"].rstrip("\ufffd") == want, msg
    status, resp = post(dep.url + "/v1/responses", {"model": dep.model, "input": text, "max_output_tokens": 12,
                                                    "temperature": 0}, timeout=120)
    assert status == 200, resp
    assert resp["output"][-1]["content"][0]["text"].rstrip("\ufffd") == want, resp
    status, tok = post(dep.url + "/tokenize", {"model": dep.model, "messages": REQUESTS["text"]["messages"]})
    chat = _chat(dep, REQUESTS["text"])
    assert status == 200 and tok["count"] == chat["usage"]["prompt_tokens"], tok


def test_completions_and_the_native_grpc_api_go_e_p_d(pd):
    """/v1/completions, and the gateway's gRPC API (an image as raw bytes, ``epd-media:0``), take the same
    two steps as REST chat, with plain vLLM's tokens."""
    dep, ref = pd
    p, d = _lms(dep)
    status, out = post(dep.url + "/v1/completions", REQUESTS["completion"], timeout=120)
    assert status == 200 and out["choices"][0]["token_ids"] == ref["completion"], out
    assert (out["epd"]["prefill_lm"], out["epd"]["lm"]) == (p.address, d.address), out["epd"]

    body = json.loads(json.dumps(REQUESTS["image"]))
    image = body["messages"][0]["content"][0]["image_url"]
    raw = base64.b64decode(image["url"].split(",", 1)[1])
    image["url"] = "epd-media:0"
    req = gateway_pb2.OpenAIRequest(body=json.dumps(body).encode(), media=[raw])
    with grpc.insecure_channel(dep.gateway_grpc) as ch:
        answer = list(gateway_pb2_grpc.GatewayServiceStub(ch).ChatCompletion(req, timeout=120))
    assert json.loads(answer[0].body)["choices"][0]["token_ids"] == ref["image"]
    facts = json.loads(answer[-1].epd)
    assert (facts["prefill_lm"], facts["lm"]) == (p.address, d.address), facts


def _lm_call(dep: Deployment, lm, req: lm_pb2.GenerateRequest, timeout: float = 60) -> list:
    with dep.client_security.channel(lm.address) as ch:
        return list(lm_pb2_grpc.LMServiceStub(ch).Generate(req, timeout=timeout))


def _handoff(rid: str, body: dict, phase, params: bytes = b"") -> lm_pb2.GenerateRequest:
    req = lm_pb2.GenerateRequest(request_id=rid)
    req.openai.api = "chat"
    req.openai.body = json.dumps(body).encode()  # the LMs render with their --chat-template
    req.kv.phase = phase
    req.kv.params = params
    return req


def _kv_usage(lm) -> float:
    return metric(lm.metrics_port, "vllm:kv_cache_usage_perc")


def test_beam_search_is_served_whole_by_one_lm_and_a_split_one_is_refused(pd):
    """Beam search calls the engine once per beam per step, so it cannot be split: the gateway sends it to
    one LM whole. Asked by hand to beam-search over a prefill LM's KV, the decode LM refuses at its second
    engine call, and neither LM holds a block after."""
    dep, _ = pd
    p, d = _lms(dep)
    beam = {**REQUESTS["text"], "use_beam_search": True, "n": 2, "max_tokens": 4}
    out = _chat(dep, beam)
    assert len(out["choices"]) == 2 and "prefill_lm" not in out["epd"], out["epd"]
    answer = _lm_call(dep, p, _handoff("beam", REQUESTS["text"], lm_pb2.KVHandoff.PREFILL))
    with pytest.raises(grpc.RpcError) as e:
        _lm_call(dep, d, _handoff("beam-d", beam, lm_pb2.KVHandoff.DECODE, answer[-1].kv_transfer_params))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "more than one engine call" in e.value.details()
    assert settled(lambda: _kv_usage(p), 0.0, timeout=30) == 0.0 and settled(lambda: _kv_usage(d), 0.0) == 0.0


def test_a_kv_pull_that_fails_is_a_clear_error_from_the_decode_lm_and_its_blocks_go(pd):
    """The gateway's two calls made by hand (a trusted peer's credentials): P prefills, then D is given
    P's kv_transfer_params with another engine id, so its NIXL handshake with P fails (vLLM checks the
    engine id P answers with). D answers UNAVAILABLE with ``epd-fault: prefill`` within seconds, holds no
    KV block, and then serves the true params with plain vLLM's tokens (which lets P's blocks go)."""
    dep, ref = pd
    p, d = _lms(dep)
    answer = _lm_call(dep, p, _handoff("kv-fault", REQUESTS["text"], lm_pb2.KVHandoff.PREFILL))
    assert answer[0].http_status == 200, answer[0].openai
    params = answer[-1].kv_transfer_params
    assert json.loads(params)["do_remote_prefill"] is True
    wrong = json.dumps({**json.loads(params), "remote_engine_id": "not-the-prefill-engine"}).encode()
    failed = _handoffs(d, "decode", "kv_unavailable")
    t0 = time.monotonic()
    with pytest.raises(grpc.RpcError) as e:
        _lm_call(dep, d, _handoff("kv-fault-d", REQUESTS["text"], lm_pb2.KVHandoff.DECODE, wrong))
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE, e.value.details()
    assert ("epd-fault", "prefill") in tuple(e.value.trailing_metadata() or ())
    assert "could not be loaded from the prefill LM" in e.value.details()
    assert time.monotonic() - t0 < 30
    assert settled(lambda: _handoffs(d, "decode", "kv_unavailable"), failed + 1) == failed + 1
    assert settled(lambda: _kv_usage(d), 0.0) == 0.0
    answer = _lm_call(dep, d, _handoff("kv-fault-d2", REQUESTS["text"], lm_pb2.KVHandoff.DECODE, params))
    tokens = [t for r in answer if r.openai for c in json.loads(r.openai).get("choices", [])
              for t in c.get("token_ids") or []]
    assert tokens == ref["text"]
    assert settled(lambda: _kv_usage(p), 0.0) == 0.0 and settled(lambda: _kv_usage(d), 0.0) == 0.0


def test_a_decode_lm_that_refuses_the_request_lets_the_prefill_lms_blocks_go_at_once(pd):
    """D refuses the DECODE call before its engine sees it (here vLLM's validation: a bad max_tokens,
    answered as vLLM answers it): it tells P's engine to release the prompt's blocks (vLLM's
    notify_kv_transfer_request_rejected), so P holds nothing long before its lease runs out."""
    dep, _ = pd
    p, d = _lms(dep)
    answer = _lm_call(dep, p, _handoff("kv-refused", REQUESTS["text"], lm_pb2.KVHandoff.PREFILL))
    assert answer[0].http_status == 200, answer[0].openai
    assert _kv_usage(p) > 0  # held for a decode LM
    bad = {**REQUESTS["text"], "max_tokens": -1}
    refusals = _handoffs(d, "decode", "refused")
    refused = _lm_call(dep, d, _handoff("kv-refused-d", bad, lm_pb2.KVHandoff.DECODE,
                                        answer[-1].kv_transfer_params))
    assert refused[0].http_status == 400, refused[0].openai
    assert settled(lambda: _handoffs(d, "decode", "refused"), refusals + 1) == refusals + 1
    assert settled(lambda: _kv_usage(p), 0.0) == 0.0 and _kv_usage(d) == 0.0


def test_a_release_call_lets_the_prefill_lms_blocks_go_at_once(pd):
    """What the gateway sends a decode LM when its DECODE call will not come (the client went away between
    the two calls): the decode LM tells the prefill LM to let the prompt's blocks go, well before its lease."""
    dep, _ = pd
    p, d = _lms(dep)
    answer = _lm_call(dep, p, _handoff("kv-release", REQUESTS["text"], lm_pb2.KVHandoff.PREFILL))
    assert answer[0].http_status == 200 and _kv_usage(p) > 0
    released = _handoffs(d, "release", "ok")
    out = _lm_call(dep, d, _handoff("kv-release", REQUESTS["text"], lm_pb2.KVHandoff.RELEASE,
                                    answer[-1].kv_transfer_params))
    assert len(out) == 1 and not out[0].openai
    assert settled(lambda: _kv_usage(p), 0.0, timeout=30) == 0.0 and _kv_usage(d) == 0.0
    assert _handoffs(d, "release", "ok") == released + 1


def _health(dep: Deployment) -> dict:
    with urllib.request.urlopen(dep.url + "/health", timeout=30) as r:
        return json.loads(r.read())


def test_a_decode_lm_killed_mid_stream_ends_the_stream_with_an_error_and_nothing_stays_held(pd):
    """D dies (SIGKILL, service and engine) after its first tokens: the client's stream ends with an
    error within seconds (no retry once tokens went out), P holds no block (D had read them) and the
    encoder no item. D is then started again and admitted."""
    dep, ref = pd
    p, d = _lms(dep)
    body = {**image_chat(3600, text="Tell me a long story.", max_tokens=400), "stream": True, "ignore_eos": True}
    tokens, errors, killed_at = 0, [], None
    for event in _chat_events(dep, body):
        if "error" in event:
            errors.append(event["error"])
            continue
        tokens += sum(len(c.get("token_ids") or []) for c in event.get("choices", []))
        if tokens and killed_at is None:
            os.killpg(d.proc.pid, signal.SIGKILL)
            killed_at = time.monotonic()
    assert killed_at is not None and errors, (tokens, errors)
    assert time.monotonic() - killed_at < 30 and tokens < 400
    d.proc.wait(30)
    assert settled(lambda: _kv_usage(p), 0.0) == 0.0
    assert settled(lambda: producer_stats(dep)["items_held"], 0) == 0
    # The gateway ejects it (its health check, or the next call), then admits the new process.
    assert settled(lambda: _health(dep)["lms"][d.address], False, timeout=30) is False
    d.start({**os.environ, "PYTHONUNBUFFERED": "1", **dep.env})
    deadline = time.monotonic() + 240
    while not _health(dep)["lms"][d.address]:
        assert d.alive() and time.monotonic() < deadline, d.log_tail()
        time.sleep(0.5)
    out = _chat(dep, REQUESTS["image"])
    assert out["choices"][0]["token_ids"] == ref["image"] and out["epd"]["lm"] == d.address


def test_a_dead_prefill_lm_leaves_the_decode_lm_serving_whole_requests(pd):
    """Last in the module: the prefill LM is killed (service and engine, SIGKILL). The next request's
    prefill call fails, the gateway retries before any token, and the decode LM, the one LM left, serves
    the whole request itself: the same tokens."""
    dep, ref = pd
    p, d = _lms(dep)
    os.killpg(p.proc.pid, signal.SIGKILL)  # its own session: the service and its engine processes
    p.proc.wait(30)
    out = _chat(dep, REQUESTS["two images"])
    assert out["choices"][0]["token_ids"] == ref["two images"]
    facts = out["epd"]
    assert facts["lm"] == d.address and "prefill_lm" not in facts, facts
