"""What the LM takes as a request's media (services.lm.media): items it loads itself only from
data: URLs, under its media limits, each recorded with the content hash of its bytes; and the
check on what vLLM's parser found: uuid-only items of the request's encoders, or data this call
loaded whose uuid (if any) is its content hash."""

from __future__ import annotations

import asyncio

import pytest

from ectransfer.connector.metadata import ItemSource
from services.common.errors import BadInput
from services.common.media import MediaConfig, MediaDecoder, content_id
from services.lm.context import RequestContext
from services.lm.media import RequestMedia, check_items
from tools.media import make_audio, make_image, make_video

pytestmark = pytest.mark.unit


def _media(namespace: str = "", **cfg) -> RequestMedia:
    return RequestMedia(MediaDecoder(MediaConfig(**cfg)), "r1", namespace)


def _load(media: RequestMedia, modality: str, data: bytes):
    return asyncio.run(media.load(modality, data, lambda b: {"decoded": len(b)}))


def test_a_loaded_item_is_recorded_with_the_content_hash_of_its_bytes_and_holds_budget_until_released():
    media, png = _media(), make_image(1, (32, 32))
    obj = _load(media, "image", png)
    assert media.hash_of(obj) == content_id(png)
    assert media.hash_of({"decoded": len(png)}) is None  # an equal object from elsewhere is not it
    assert media.decoder.budget.used == 32 * 32 * 4
    media.release()
    media.release()
    assert media.decoder.budget.used == 0 and media.hash_of(obj) is None


@pytest.mark.parametrize("modality, data, cfg, needle", [
    ("image", make_image(2, (64, 64)), {"max_image_pixels": 1000}, "more than the 1000 allowed"),
    ("image", b"not an image", {}, "not a recognised image"),
    ("audio", make_audio(1, 2.0), {"max_audio_seconds": 1.0}, "more than the 1 s allowed"),
    ("video", make_video(1, frames=8, fps=4.0), {"max_video_fps": 2.0}, "--max-video-fps"),
    ("video", make_video(1, frames=8, fps=4.0), {"max_video_frames": 4}, "--max-video-frames"),
    ("video", make_video(1, frames=8, fps=4.0), {"max_video_seconds": 1.0}, "--max-video-seconds"),
], ids=["pixels", "not-an-image", "audio-length", "video-fps", "video-frames", "video-length"])
def test_an_item_over_a_limit_is_refused_from_its_header_and_holds_nothing(modality, data, cfg, needle):
    media = _media(**cfg)
    with pytest.raises(BadInput, match=needle):
        _load(media, modality, data)
    assert media.decoder.budget.used == 0 and not media.loaded


def test_the_request_pixel_budget_counts_every_image_of_the_call():
    media = _media(max_request_pixels=4000)
    _load(media, "image", make_image(1, (50, 50)))
    with pytest.raises(BadInput, match="--max-request-pixels"):
        _load(media, "image", make_image(2, (50, 50)))


def _ctx(media: RequestMedia | None = None, sources=("enc-item",)) -> RequestContext:
    return RequestContext(sources={s: ItemSource("e:1", 64, "bfloat16") for s in sources}, media=media)


def test_items_the_gateway_sends_pass_the_check():
    media, png = _media(), make_image(3, (16, 16))
    obj, obj2 = _load(media, "image", png), _load(media, "image", png)
    check_items({"multi_modal_data": {"image": [None, obj, obj2]},
                 "multi_modal_uuids": {"image": ["enc-item", content_id(png), None]}}, _ctx(media))
    check_items({"multi_modal_data": {"image": [obj]}}, _ctx(media))  # no uuids at all: vLLM hashes
    check_items({}, _ctx(None))  # text only


@pytest.mark.parametrize("case", ["uuid-not-a-source", "no-uuid-no-data", "foreign-object", "other-hash",
                                  "no-loader", "prompt-embeds", "vision-chunk"])
def test_items_the_gateway_does_not_send_are_refused(case):
    media, png, other = _media(), make_image(4, (16, 16)), make_image(5, (16, 16))
    obj = _load(media, "image", png)
    prompt = {
        "uuid-not-a-source": {"multi_modal_data": {"image": [None]}, "multi_modal_uuids": {"image": ["victim"]}},
        "no-uuid-no-data": {"multi_modal_uuids": {"image": [None]}},
        "foreign-object": {"multi_modal_data": {"image": [{"decoded": 1}]}},
        "other-hash": {"multi_modal_data": {"image": [obj]}, "multi_modal_uuids": {"image": [content_id(other)]}},
        "no-loader": {"multi_modal_data": {"image": [obj]}},
        "prompt-embeds": {"multi_modal_data": {"prompt_embeds": ["x"]}},
        "vision-chunk": {"multi_modal_data": {"vision_chunk": [obj]}},
    }[case]
    with pytest.raises(BadInput):
        check_items(prompt, _ctx(None if case == "no-loader" else media))


def test_in_a_namespace_items_are_hashed_in_it_and_an_item_without_uuid_gets_its_namespaced_hash():
    media, png = _media("acme:"), make_image(3, (16, 16))
    obj, obj2 = _load(media, "image", png), _load(media, "image", png)
    assert media.hash_of(obj) == content_id(png, "acme:") != content_id(png)
    prompt = {"multi_modal_data": {"image": [None, obj, obj2]},
              "multi_modal_uuids": {"image": ["enc-item", content_id(png, "acme:"), None]}}
    check_items(prompt, _ctx(media))
    # vLLM takes the uuid as the item's mm_hash: the pixels' own hash would be the same for every tenant.
    assert prompt["multi_modal_uuids"]["image"] == ["enc-item", content_id(png, "acme:"), content_id(png, "acme:")]
    bare = {"multi_modal_data": {"image": [obj]}}
    check_items(bare, _ctx(media))
    assert bare["multi_modal_uuids"] == {"image": [content_id(png, "acme:")]}


def test_without_a_namespace_an_item_without_uuid_is_left_to_vllm_s_hash():
    media, png = _media(), make_image(3, (16, 16))
    bare = {"multi_modal_data": {"image": [_load(media, "image", png)]}}
    check_items(bare, _ctx(media))
    assert "multi_modal_uuids" not in bare


@pytest.mark.parametrize("uuid_ns", ["", "other:"], ids=["bare-hash", "another-tenant"])
def test_in_a_namespace_a_uuid_hashed_outside_it_is_refused(uuid_ns):
    media, png = _media("acme:"), make_image(3, (16, 16))
    obj = _load(media, "image", png)
    with pytest.raises(BadInput, match="namespace"):
        check_items({"multi_modal_data": {"image": [obj]},
                     "multi_modal_uuids": {"image": [content_id(png, uuid_ns)]}}, _ctx(media))


def test_bytes_an_encoder_laid_out_are_known_by_their_hash_in_the_request_s_namespace():
    png = make_image(6, (16, 16))
    for ns in ("acme:", ""):
        media = _media(ns)
        ctx = _ctx(media, sources=(content_id(png, "acme:"),))
        ctx.layouts[content_id(png, "acme:")] = object()
        found = media.encoded_elsewhere("image", png, ctx)
        assert (found is not None) == (ns == "acme:")  # another namespace's item is not this request's
