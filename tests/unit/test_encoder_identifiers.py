"""The encoder names every item itself (``EncoderServicer.Encode``): the identifier it hands vLLM as the
item's mm_hash is the content hash of (the request's embedding namespace, the bytes), and a caller's
identifier that is not that is refused before anything is decoded. The engine is a stand-in that records
what vLLM's processor would be handed."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from epd.encoder.v1 import encoder_pb2
from services.common.errors import BadInput
from services.common.media import MediaConfig, MediaDecoder, content_id
from services.encoder.servicer import EncoderServicer
from tools.media import make_image

pytestmark = pytest.mark.unit


class _Handed(Exception):
    """Raised by the stand-in engine once the prompt reached vLLM's processor."""


class _Engine:
    def __init__(self) -> None:
        self.model_config = SimpleNamespace(multimodal_config=SimpleNamespace(get_limit_per_prompt=lambda m: 4),
                                            is_encoder_decoder=False)
        self.input_processor = self
        self.uuids: list[dict] = []

    async def get_supported_tasks(self):
        return ("generate",)

    async def process_inputs_async(self, rid, prompt, params, supported_tasks=()):
        self.uuids.append(prompt["multi_modal_uuids"])
        raise _Handed


def _encode(engine: _Engine, items: list[encoder_pb2.MediaItem], namespace: str = "") -> None:
    """One Encode call on an encoder over ``engine``; raises what the call raised (``_Handed`` once the
    prompt reached vLLM's processor)."""
    servicer = EncoderServicer(engine, encoder_pb2.EncoderInfo(encoder_id="e"), {"image": lambda i: "<image>"},
                               {"": 64}, 0, 5.0, MediaDecoder(MediaConfig()))

    async def main():
        request = encoder_pb2.EncodeRequest(request_id="r", items=items, namespace=namespace)
        async for _ in servicer.Encode(request, None):
            pass

    asyncio.run(main())


def _handed(items: list[encoder_pb2.MediaItem], namespace: str = "") -> list[dict]:
    """The ``multi_modal_uuids`` one Encode call handed vLLM's processor."""
    engine = _Engine()
    with pytest.raises(_Handed):
        _encode(engine, items, namespace)
    return engine.uuids


def test_the_encoder_names_items_by_their_bytes_in_the_requests_namespace():
    png = make_image(1, (32, 32))
    assert _handed([encoder_pb2.MediaItem(modality="image", data=png)]) == [{"image": [content_id(png)]}]
    assert _handed([encoder_pb2.MediaItem(modality="image", data=png)], "a:") == [{"image": [content_id(png, "a:")]}]
    assert content_id(png, "a:") != content_id(png) != content_id(png, "b:")
    # The caller's identifier is taken when it is the one the encoder computes.
    given = encoder_pb2.MediaItem(modality="image", data=png, identifier=content_id(png, "b:"))
    assert _handed([given], "b:") == [{"image": [content_id(png, "b:")]}]


@pytest.mark.parametrize("claimed_ns, request_ns", [("", "a:"), ("b:", "a:"), ("a:", "")],
                         ids=["bare-hash-in-a-namespace", "another-tenants", "a-tenants-without-namespace"])
def test_the_encoder_refuses_an_identifier_that_is_not_the_hash_of_the_bytes_in_the_requests_namespace(
        claimed_ns, request_ns):
    png = make_image(2, (32, 32))
    item = encoder_pb2.MediaItem(modality="image", data=png, identifier=content_id(png, claimed_ns))
    engine = _Engine()
    with pytest.raises(BadInput, match="not the content hash of its bytes in the request's namespace"):
        _encode(engine, [item], request_ns)
    assert engine.uuids == []  # refused before anything reached vLLM


def test_the_encoder_refuses_a_namespace_longer_than_a_tenants():
    png = make_image(3, (32, 32))
    with pytest.raises(BadInput, match="at most 128"):
        _encode(_Engine(), [encoder_pb2.MediaItem(modality="image", data=png)], "n" * 200)
