"""The LM's own processor path (items without a prompt layout from an
encoder): vLLM's InputProcessor on the tiny model runs for real, the engine is
a stand-in that records what it was handed. The decode budget is back before
the engine sees the request (a request queued for KV space holds none), and
each item's mm_hash is the content hash of its bytes, never a caller's label."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from epd.lm.v1 import lm_pb2
from services.common.errors import BadInput
from services.common.images import make_image
from services.common.media import ImageDecoder, MediaConfig, content_id
from services.lm.servicer import LMServicer

pytestmark = pytest.mark.integration


class _Engine:
    """What LMServicer uses of AsyncLLM: the real InputProcessor, and a
    ``generate`` that records the request and the decode budget in use then,
    and answers one finished output."""

    def __init__(self, input_processor, decoder: ImageDecoder) -> None:
        self.input_processor = input_processor
        self.model_config = input_processor.model_config
        self.decoder = decoder
        self.seen: list[tuple[object, int]] = []

    async def get_supported_tasks(self):
        return ("generate",)

    async def generate(self, request, params, rid, **kw):
        self.seen.append((request, self.decoder.budget.used))
        yield SimpleNamespace(finished=True, ec_transfer_params=None, prompt_token_ids=[1], metrics=None,
                              outputs=[SimpleNamespace(token_ids=[7], text="x", finish_reason="stop")])

    async def abort(self, rid):
        pass


@pytest.fixture(scope="module")
def input_processor(tiny_model):
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.engine.input_processor import InputProcessor

    cfg = EngineArgs(model=tiny_model, dtype="bfloat16", seed=0, enforce_eager=True, mm_processor_cache_gb=0,
                     limit_mm_per_prompt={"image": 8}).create_engine_config()
    return InputProcessor(cfg)


def _generate(input_processor, items: list[lm_pb2.MMItem]):
    decoder = ImageDecoder(MediaConfig(decode_wait_s=60))
    engine = _Engine(input_processor, decoder)
    servicer = LMServicer(engine, lm_pb2.LMInfo(), peers=None, default_max_tokens=4, decoder=decoder)
    from vllm.model_executor.models.registry import ModelRegistry

    mc = input_processor.model_config
    placeholder = ModelRegistry.resolve_model_cls(mc.architectures, mc)[0].get_placeholder_str("image", 1)
    request = lm_pb2.GenerateRequest(request_id="r", prompt=placeholder * len(items) + "What is this?",
                                     items=items)

    async def main():
        try:
            return [r async for r in servicer.Generate(request, None)]
        finally:
            decoder.close()

    return asyncio.run(main()), engine, decoder


def test_the_decode_budget_is_back_before_the_engine_sees_the_request(input_processor):
    data = [make_image(1, (224, 224)), make_image(2, (300, 200))]
    responses, engine, decoder = _generate(input_processor,
                                           [lm_pb2.MMItem(modality="image", data=d) for d in data])
    assert responses[-1].finish_reason == "stop"
    (request, used), = engine.seen
    assert used == 0 and decoder.budget.used == 0
    assert [f.identifier for f in request.mm_features] == [content_id(d) for d in data]


def test_an_identifier_that_is_not_the_content_hash_of_the_bytes_is_refused(input_processor):
    a, b = make_image(3, (64, 64)), make_image(4, (64, 64))
    with pytest.raises(BadInput, match="item 0: identifier .* is not the content hash of its bytes"):
        _generate(input_processor, [lm_pb2.MMItem(modality="image", data=a, identifier=content_id(b))])


def test_the_callers_identifier_is_kept_when_it_is_the_content_hash(input_processor):
    a = make_image(5, (64, 64))
    _, engine, _ = _generate(input_processor, [lm_pb2.MMItem(modality="image", data=a, identifier=content_id(a))])
    (request, _), = engine.seen
    assert [f.identifier for f in request.mm_features] == [content_id(a)]
