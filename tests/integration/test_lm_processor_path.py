"""The LM's own processor path: images that reach the LM as data: URLs (an
encoder without a prompt layout, or no encoder at all) are processed here by
vLLM's renderer and InputProcessor on the tiny model, for real, through the
LM's vLLM serving classes (``build_frontend``); the engine is a stand-in that
records the request it was handed. An item an encoder has is processed under
its identifier (vLLM's mm_hash, the uuid in the body), so the connector pulls
the encoder's embedding for it; that identifier must be the content hash of the
bytes, never a caller's label for other bytes."""

from __future__ import annotations

import asyncio
import json

import pytest

from epd.common.v1 import common_pb2
from epd.lm.v1 import lm_pb2
from services.common.errors import BadInput
from services.common.images import data_url, make_image
from services.common.media import content_id
from services.lm.frontend import FrontendConfig, build_frontend
from services.lm.servicer import LMServicer

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

    def __init__(self) -> None:
        self.checked: list[str] = []

    async def check(self, endpoint: str) -> None:
        self.checked.append(endpoint)


@pytest.fixture(scope="module")
def vllm_config(tiny_model):
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(model=tiny_model, dtype="bfloat16", seed=0, enforce_eager=True, mm_processor_cache_gb=0,
                      limit_mm_per_prompt={"image": 8}).create_engine_config()


def item(data: bytes, identifier: str | None = None, encoder: bool = True) -> tuple[lm_pb2.MMItem, dict]:
    """An image as the gateway sends it when no layout came with its metadata: the item (with its encoder,
    unless ``encoder`` is false) and its part, a data: URL with the identifier (default: the content
    hash) as uuid, or no uuid without an encoder."""
    ident = content_id(data) if identifier is None else identifier
    mm = lm_pb2.MMItem(modality="image", identifier=ident)
    part = {"type": "image_url", "image_url": {"url": data_url(data)}}
    if encoder:
        mm.source.CopyFrom(lm_pb2.ItemSource(transfer_endpoint=ENDPOINT, encoder_id="enc-A", num_embeds=16,
                                             embed_width=64, dtype=common_pb2.BFLOAT16))
        part["uuid"] = ident
    return mm, part


def _generate(vllm_config, tiny_model, images: list[tuple[lm_pb2.MMItem, dict]]):
    engine = _Engine(vllm_config)
    peers = _Peers()
    body = {"messages": [{"role": "user", "content": [p for _, p in images] + [
        {"type": "text", "text": "What is this?"}]}], "max_tokens": 4}
    request = lm_pb2.GenerateRequest(request_id="r", items=[mm for mm, _ in images])
    request.openai.api = "chat"
    request.openai.body = json.dumps(body).encode()

    async def main():
        frontend = await build_frontend(engine, FrontendConfig(), tiny_model)
        servicer = LMServicer(engine, lm_pb2.LMInfo(), peers, frontend)
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
    with pytest.raises(BadInput, match="image uuid .* is not the content hash of its bytes"):
        _generate(vllm_config, tiny_model, [item(a, identifier=content_id(b))])


def test_an_image_without_data_and_without_an_encoder_is_refused(vllm_config, tiny_model):
    a = make_image(6, (64, 64))
    mm, _ = item(a, encoder=False)
    with pytest.raises(BadInput, match="has no data and no encoder"):
        _generate(vllm_config, tiny_model, [(mm, {"type": "image_url", "image_url": None, "uuid": mm.identifier})])
