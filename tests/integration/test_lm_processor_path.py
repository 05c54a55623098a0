"""The LM's own processor path: images that reach the LM as data: URLs (an
encoder without a prompt layout, or no encoder at all) are processed here by
vLLM's renderer and InputProcessor on the tiny model, for real, through the
LM's vLLM serving classes (``build_frontend``); the engine is a stand-in that
records the request it was handed. An item an encoder has is processed under
its identifier (vLLM's mm_hash, the uuid in the body), so the connector pulls
the encoder's embedding for it; that identifier must be the content hash of the
bytes, never a caller's label for other bytes. The LM's own media connector is
selected as in the service (``services.lm.media_connector``): every media part
shape that did not come from the gateway is refused, and nothing is downloaded."""

from __future__ import annotations

import asyncio
import json

import pytest

from epd.lm.v1 import lm_pb2
from epd.transfer.v1 import transfer_pb2
from services.common.errors import BadInput
from services.common.media import MediaConfig, MediaDecoder, content_id
from services.lm.config import FrontendConfig
from services.lm.frontend import build_frontend
from services.lm.servicer import LMServicer
from tools.media import data_url, make_image

pytestmark = pytest.mark.integration

ENDPOINT = "enc-A:1"


class _Engine:
    """What the LM's front end uses of AsyncLLM: the real renderer and InputProcessor, and a ``generate``
    that turns the rendered input into the engine's request (as ``AsyncLLM.add_request`` does), records
    it with its sampling parameters, and answers one finished output."""

    def __init__(self, vllm_config) -> None:
        from vllm.renderers import renderer_from_config
        from vllm.v1.engine.input_processor import InputProcessor

        self.vllm_config = vllm_config
        self.model_config = vllm_config.model_config
        self.renderer = renderer_from_config(vllm_config)
        self.input_processor = InputProcessor(vllm_config, self.renderer)
        self.errored = False
        self.seen: list[tuple[object, object]] = []  # (EngineCoreRequest, SamplingParams)

    def check_admission(self, n: int = 1, request_id: str | None = None) -> None:
        pass

    async def get_supported_tasks(self):
        return ("generate",)

    async def generate(self, prompt, params, request_id, **kw):
        from vllm.outputs import CompletionOutput, RequestOutput

        request = self.input_processor.process_inputs(request_id, prompt, params,
                                                      supported_tasks=await self.get_supported_tasks())
        self.seen.append((request, params))
        yield RequestOutput(request_id, None, list(request.prompt_token_ids), None,
                            [CompletionOutput(index=0, text="x", token_ids=[7], cumulative_logprob=None,
                                              logprobs=None, finish_reason="stop")], finished=True)

    async def abort(self, rid, *args, **kw):
        pass


class _Peers:
    """The LM's PeerChecker: every encoder endpoint passes."""

    transport: dict[str, str] = {}
    consumer_id = "lm-engine-1"  # an EC consumer (an encoder-decoder model's LM has none)

    def __init__(self) -> None:
        self.checked: list[str] = []

    async def check(self, endpoint: str) -> None:
        self.checked.append(endpoint)


@pytest.fixture(scope="module", autouse=True)
def gateway_only_media():
    """The LM process's media connector, as ``services.lm.server`` selects it (restored after)."""
    from services.lm import media_connector

    mp = pytest.MonkeyPatch()
    mp.setenv(media_connector.ENV, media_connector.NAME)
    media_connector.install()
    yield
    mp.undo()


@pytest.fixture(scope="module")
def vllm_config(tiny_model):
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(model=tiny_model, dtype="bfloat16", seed=0, enforce_eager=True, mm_processor_cache_gb=0,
                      limit_mm_per_prompt={"image": 8}).create_engine_config()


def item(data: bytes, identifier: str | None = None, encoder: bool = True,
         namespace: str = "") -> tuple[lm_pb2.MMItem, dict]:
    """An image as the gateway sends it when no layout came with its metadata: the item (with its encoder,
    unless ``encoder`` is false) and its part, a data: URL with the identifier (default: the content
    hash in ``namespace``) as uuid, or no uuid without an encoder."""
    ident = content_id(data, namespace) if identifier is None else identifier
    mm = lm_pb2.MMItem(modality="image", identifier=ident)
    part = {"type": "image_url", "image_url": {"url": data_url(data)}}
    if encoder:
        mm.source.CopyFrom(transfer_pb2.ItemSource(transfer_endpoint=ENDPOINT, encoder_id="enc-A", num_embeds=16,
                                             embed_width=64, dtype=transfer_pb2.BFLOAT16))
        part["uuid"] = ident
    return mm, part


def _generate(vllm_config, tiny_model, images: list[tuple[lm_pb2.MMItem | None, dict]],
              decoder: MediaDecoder | None = None, namespace: str = ""):
    """One Generate call through the LM's servicer and vLLM's serving classes: the parts in one user
    message (their items, where not None, in ``GenerateRequest.items``), in the embedding ``namespace``."""
    engine = _Engine(vllm_config)
    peers = _Peers()
    body = {"messages": [{"role": "user", "content": [p for _, p in images] + [
        {"type": "text", "text": "What is this?"}]}], "max_tokens": 4}
    request = lm_pb2.GenerateRequest(request_id="r", items=[mm for mm, _ in images if mm is not None],
                                     namespace=namespace)
    request.openai.api = "chat"
    request.openai.body = json.dumps(body).encode()
    decoder = decoder or MediaDecoder(MediaConfig())

    async def main():
        frontend = await build_frontend(engine, FrontendConfig(), tiny_model)
        servicer = LMServicer(engine, lm_pb2.LMInfo(), peers, frontend, decoder)
        return [r async for r in servicer.Generate(request, None)]

    try:
        return asyncio.run(main()), engine, peers
    finally:
        if hasattr(engine.renderer, "shutdown"):
            engine.renderer.shutdown()


def test_items_an_encoder_sent_without_a_layout_are_processed_here_under_their_identifiers(vllm_config, tiny_model):
    data = [make_image(1, (224, 224)), make_image(2, (300, 200))]
    responses, engine, peers = _generate(vllm_config, tiny_model, [item(d) for d in data])
    assert responses[0].http_status == 200
    answer = json.loads(responses[0].openai)
    assert answer["choices"][0]["message"]["content"] == "x"
    last = responses[-1]
    assert last.HasField("timings") and not last.openai and last.finish_reason == "stop"
    (request, params), = engine.seen
    # vLLM's processor ran on the bytes (the prompt is laid out here, the pixels processed) ...
    assert len(request.mm_features) == 2 and all(f.data is not None for f in request.mm_features)
    # ... under the content hashes, the mm_hashes the encoder keyed its embeddings by,
    assert [f.identifier for f in request.mm_features] == [content_id(d) for d in data]
    # and the connector is told to pull each one from its encoder.
    assert set(params.extra_args["ec_transfer_params"]["items"]) == {content_id(d) for d in data}
    assert peers.checked == [ENDPOINT]


def test_an_image_without_an_encoder_is_processed_and_hashed_by_vllm(vllm_config, tiny_model):
    a = make_image(5, (64, 64))
    responses, engine, peers = _generate(vllm_config, tiny_model, [item(a, encoder=False)])
    assert responses[0].http_status == 200 and responses[-1].finish_reason == "stop"
    (request, params), = engine.seen
    (feature,) = request.mm_features
    assert feature.data is not None and feature.identifier  # vLLM's own hash: nobody else needs to know it
    assert "ec_transfer_params" not in (params.extra_args or {}) and peers.checked == []


def test_an_identifier_that_is_not_the_content_hash_of_the_bytes_is_refused(vllm_config, tiny_model):
    a, b = make_image(3, (64, 64)), make_image(4, (64, 64))
    with pytest.raises(BadInput, match="image 0: its uuid .* is not the content hash of its bytes"):
        _generate(vllm_config, tiny_model, [item(a, identifier=content_id(b))])


def test_in_a_tenants_namespace_items_are_processed_under_its_identifiers_and_others_are_refused(
        vllm_config, tiny_model):
    """With an embedding namespace (a tenant's), an encoder's item is processed under the content hash
    of (namespace, bytes), and the bare content hash, or another tenant's, is refused for those bytes."""
    a = make_image(7, (64, 64))
    _, engine, _ = _generate(vllm_config, tiny_model, [item(a, namespace="t1:")], namespace="t1:")
    (request, params), = engine.seen
    assert [f.identifier for f in request.mm_features] == [content_id(a, "t1:")]
    assert set(params.extra_args["ec_transfer_params"]["items"]) == {content_id(a, "t1:")}
    for wrong in ("", "t2:"):
        with pytest.raises(BadInput, match="not the content hash of its bytes in the request's namespace"):
            _generate(vllm_config, tiny_model, [item(a, namespace=wrong)], namespace="t1:")


def test_an_image_the_lm_encodes_itself_is_hashed_in_its_tenants_namespace(vllm_config, tiny_model):
    """vLLM would hash the pixels alike for every tenant (and its encoder cache would serve one tenant's
    image to another): in a namespace the LM names the item itself, so two tenants' sends of the same
    image are different items and one tenant's second send is the same one."""
    a = make_image(8, (64, 64))

    def identifier(namespace: str) -> str:
        _, engine, _ = _generate(vllm_config, tiny_model, [item(a, encoder=False)], namespace=namespace)
        (request, _), = engine.seen
        (feature,) = request.mm_features
        return feature.identifier

    first, other, again = identifier("t1:"), identifier("t2:"), identifier("t1:")
    assert first == again == content_id(a, "t1:") and other == content_id(a, "t2:") != first
    assert identifier("") not in (first, other)  # no namespace: vLLM's own hash, as before


def test_an_image_without_data_and_without_an_encoder_is_refused(vllm_config, tiny_model):
    a = make_image(6, (64, 64))
    mm, _ = item(a, encoder=False)
    with pytest.raises(BadInput, match="has no data and no encoder"):
        _generate(vllm_config, tiny_model, [(mm, {"type": "image_url", "image_url": None, "uuid": mm.identifier})])


@pytest.fixture(scope="module")
def bait():
    """An HTTP server on loopback that counts every request: nothing on the LM may reach it."""
    import http.server
    import threading

    hits: list[str] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            hits.append(self.path)
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.end_headers()
            self.wfile.write(make_image(9, (32, 32)))

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/bait.png", hits
    server.shutdown()


def _refusal(vllm_config, tiny_model, parts: list[tuple[lm_pb2.MMItem | None, dict]]) -> str:
    """Sends ``parts`` straight to the LM (no gateway) and returns how it was refused: a BadInput
    from the LM's check (INVALID_ARGUMENT at the service boundary) or vLLM's own 4xx answer.
    Fails if anything reached the engine."""
    try:
        responses, engine, _ = _generate(vllm_config, tiny_model, parts)
    except BadInput as e:
        return str(e)
    assert 400 <= responses[0].http_status < 500, responses[0].openai[:300]
    assert engine.seen == []
    return json.loads(responses[0].openai)["error"]["message"]


VICTIM, ATTACKER = make_image(11, (64, 64)), make_image(12, (64, 64))


@pytest.mark.parametrize("shape", [
    "typed-http", "untyped-http", "untyped-http-string", "input-image-http", "file-url", "uuid-on-text-part",
    "uuid-with-other-bytes", "uuid-only-not-sent", "untyped-uuid-with-other-bytes", "image-embeds",
    "audio-url-http", "data-url-wrong-type",
])
def test_the_lm_refuses_every_media_shape_the_gateway_does_not_send_and_downloads_nothing(
        vllm_config, tiny_model, bait, shape):
    url, hits = bait
    victim = content_id(VICTIM)
    part = {
        "typed-http": {"type": "image_url", "image_url": {"url": url}},
        "untyped-http": {"image_url": {"url": url}},
        "untyped-http-string": {"image_url": url, "text": "hi"},
        "input-image-http": {"type": "input_image", "image_url": url, "detail": "auto"},
        "file-url": {"type": "image_url", "image_url": {"url": "file:///etc/hostname"}},
        "uuid-on-text-part": {"type": "text", "text": "hi", "uuid": victim, "image_url": {"url": data_url(ATTACKER)}},
        "uuid-with-other-bytes": {"type": "image_url", "image_url": {"url": data_url(ATTACKER)}, "uuid": victim},
        "uuid-only-not-sent": {"type": "image_url", "image_url": None, "uuid": victim},
        "untyped-uuid-with-other-bytes": {"image_url": data_url(ATTACKER), "uuid": victim},
        "image-embeds": {"type": "image_embeds", "image_embeds": "AAAA"},
        "audio-url-http": {"type": "audio_url", "audio_url": {"url": url}},
        "data-url-wrong-type": {"type": "image_url", "image_url": {"url": data_url(ATTACKER, "text/plain")}},
    }[shape]
    message = _refusal(vllm_config, tiny_model, [(None, part)])
    assert message
    assert hits == [], f"the LM fetched {hits}"


def test_a_victim_item_an_encoder_has_is_not_taken_from_a_callers_bytes(vllm_config, tiny_model):
    """The poisoning shape at the LM: the victim's identifier, with an encoder source, on a part
    whose bytes are the attacker's: refused, so nothing is cached under the victim's identifier."""
    mm, _ = item(VICTIM)
    part = {"type": "text", "text": "hi", "uuid": mm.identifier, "image_url": {"url": data_url(ATTACKER)}}
    assert "not the content hash" in _refusal(vllm_config, tiny_model, [(mm, part)])


def test_an_image_over_the_lms_pixel_limit_is_refused_before_decoding(vllm_config, tiny_model):
    big = make_image(13, (300, 300))
    with pytest.raises(BadInput, match="more than the 50000 allowed"):
        _generate(vllm_config, tiny_model, [item(big, encoder=False)],
                  decoder=MediaDecoder(MediaConfig(max_image_pixels=50_000)))


def test_building_vllms_app_leaves_the_services_logging_as_it_was(vllm_config, tiny_model):
    """vLLM's app pulls in SageMaker's hosting standards, which set the root logger to ERROR: the
    LM's own INFO and WARNING lines would vanish. The root logger's levels are put back."""
    import logging

    root = logging.getLogger()
    handler = logging.StreamHandler()
    handler.setLevel(logging.INFO)
    root.addHandler(handler)
    before = root.level
    root.setLevel(logging.INFO)
    try:
        _generate(vllm_config, tiny_model, [])
        assert root.level == logging.INFO and handler.level == logging.INFO
    finally:
        root.removeHandler(handler)
        root.setLevel(before)


def _stored_responses_lm(vllm_config, tiny_model, monkeypatch, max_entries: int):
    """An LM servicer over vLLM's own Responses serving class with its store on, bounded at ``max_entries``
    (services/lm/response_store.py): its ``call(method, path, body, namespace)`` answers the HTTP status,
    and the serving object and engine to shut down."""
    from services.lm.response_store import StoredResponses

    monkeypatch.setenv("VLLM_ENABLE_RESPONSES_API_STORE", "1")
    engine = _Engine(vllm_config)

    async def build():
        frontend = await build_frontend(engine, FrontendConfig(), tiny_model)
        return frontend, StoredResponses.of_app(frontend.app, max_entries=max_entries, max_bytes=1 << 30)

    frontend, stored = asyncio.run(build())
    servicer = LMServicer(engine, lm_pb2.LMInfo(), _Peers(), frontend, MediaDecoder(MediaConfig()), stored)

    async def _collect(gen):
        return [r async for r in gen]

    def call(method: str, path: str, body: dict | None = None, namespace: str = "") -> int:
        request = lm_pb2.GenerateRequest(request_id="r", namespace=namespace)
        request.openai.api, request.openai.method, request.openai.path = "http", method, path
        if body is not None:
            request.openai.body = json.dumps(body).encode()
            request.openai.content_type = "application/json"
        return asyncio.run(_collect(servicer.Generate(request, None)))[0].http_status

    return call, frontend.app.state.openai_serving_responses, engine


def _store_one(call, rid: str, namespace: str = "") -> None:
    body = {"input": "Hello", "max_output_tokens": 4, "request_id": rid}
    assert call("POST", "/v1/responses", body, namespace) == 200


def test_stored_responses_past_the_bound_are_forgotten_oldest_first(vllm_config, tiny_model, monkeypatch):
    """vLLM's own Responses serving class with its store on (services/lm/response_store.py): a third stored
    response makes the LM forget the first (its GET is vLLM's 404); the two newest stay."""
    call, serving, engine = _stored_responses_lm(vllm_config, tiny_model, monkeypatch, max_entries=2)
    try:
        ids = [f"resp_{i:032x}" for i in range(3)]
        for rid in ids:
            _store_one(call, rid)
        assert [call("GET", f"/v1/responses/{rid}") for rid in ids] == [404, 200, 200]
        assert list(serving.response_store) == ids[1:] and set(serving.msg_store) == set(ids[1:])
    finally:
        if hasattr(engine.renderer, "shutdown"):
            engine.renderer.shutdown()


def test_a_tenants_stored_response_survives_another_tenant_storing_past_the_bound(vllm_config, tiny_model,
                                                                                  monkeypatch):
    """vLLM's store shared by tenant (the request's namespace): bob's new responses evict his own oldest, and
    alice's, within her share, stays."""
    call, serving, engine = _stored_responses_lm(vllm_config, tiny_model, monkeypatch, max_entries=2)
    try:
        _store_one(call, "resp_alice", "alice:")
        bobs = [f"resp_bob{i}" for i in range(3)]
        for rid in bobs:
            _store_one(call, rid, "bob:")
        assert call("GET", "/v1/responses/resp_alice") == 200
        assert [call("GET", f"/v1/responses/{rid}") for rid in bobs] == [404, 404, 200]
        assert list(serving.response_store) == ["resp_alice", "resp_bob2"]
    finally:
        if hasattr(engine.renderer, "shutdown"):
            engine.renderer.shutdown()


def _generate_http(vllm_config, tiny_model, path: str, body: dict, namespace: str = ""):
    """One Generate call of api "http" (vLLM's own app in the LM) through the LM's servicer."""
    engine = _Engine(vllm_config)
    request = lm_pb2.GenerateRequest(request_id="r", namespace=namespace)
    request.openai.api, request.openai.method, request.openai.path = "http", "POST", path
    request.openai.body = json.dumps(body).encode()

    async def main():
        frontend = await build_frontend(engine, FrontendConfig(), tiny_model)
        servicer = LMServicer(engine, lm_pb2.LMInfo(), _Peers(), frontend, MediaDecoder(MediaConfig()))
        return [r async for r in servicer.Generate(request, None)]

    try:
        return asyncio.run(main()), engine
    finally:
        if hasattr(engine.renderer, "shutdown"):
            engine.renderer.shutdown()


@pytest.mark.parametrize("api", ["messages", "responses"])
def test_an_image_the_lm_decodes_through_vllms_app_is_hashed_in_its_tenants_namespace(vllm_config, tiny_model, api):
    """vLLM's Messages converter drops any uuid, and a Responses input_image stored by vLLM is rendered again
    without its encoder: the LM still names each image it decodes in the request's namespace."""
    import base64

    a = make_image(9, (64, 64))
    if api == "messages":
        path, body = "/v1/messages", {"model": tiny_model, "max_tokens": 2, "messages": [{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": base64.b64encode(a).decode()}},
            {"type": "text", "text": "What is this?"}]}]}
    else:
        content = [{"type": "input_image", "image_url": data_url(a), "detail": "auto"},
                   {"type": "input_text", "text": "What is this?"}]
        path, body = "/v1/responses", {"model": tiny_model, "max_output_tokens": 2,
                                       "input": [{"role": "user", "content": content}]}
    responses, engine = _generate_http(vllm_config, tiny_model, path, body, namespace="t1:")
    assert responses[0].http_status == 200, responses[0].openai[:300]
    (request, _), = engine.seen
    assert [f.identifier for f in request.mm_features] == [content_id(a, "t1:")]
