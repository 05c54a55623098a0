"""Image decoding guard rails and content identity."""

import asyncio
import hashlib
import threading
import time

import grpc
import pytest

from services.common.budget import ByteBudget
from services.common.errors import BadInput, NoCapacity
from services.common.media import MediaConfig, MediaDecoder, check_namespace, content_id
from services.common.media_checks import BYTES_PER_PIXEL, decode_image
from tests.unit.helpers import image_bytes
from tools.media import bomb_png

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("fmt, mode", [("PNG", "RGB"), ("PNG", "RGBA"), ("PNG", "L"), ("JPEG", "RGB"), ("JPEG", "L")])
def test_valid_images_decode_to_rgb(fmt, mode):
    img = decode_image(image_bytes(fmt, size=(8, 6), mode=mode))
    assert img.mode == "RGB" and img.size == (8, 6)


def test_decoded_pixels_are_the_encoded_ones():
    img = decode_image(image_bytes("PNG", size=(3, 2)))
    assert img.getpixel((2, 1)) == (10, 200, 30)


@pytest.mark.parametrize(
    "data, needle",
    [
        (b"", "image is empty"),
        (b"definitely not an image", "could not be decoded"),
        (b"\x89PNG\r\n\x1a\n", "could not be decoded"),  # a signature and nothing else
    ],
    ids=["empty", "garbage", "signature-only"],
)
def test_bad_bytes_raise_badinput(data, needle):
    with pytest.raises(BadInput, match=needle):
        decode_image(data)


@pytest.mark.parametrize("fmt", ["PNG", "JPEG"])
def test_a_truncated_image_raises_badinput(fmt):
    data = image_bytes(fmt, size=(64, 64), noise=True)
    with pytest.raises(BadInput, match="could not be decoded"):
        decode_image(data[: len(data) // 2])


def test_an_image_over_max_pixels_is_refused_before_decoding():
    data = image_bytes("PNG", size=(10, 10))
    assert decode_image(data, max_pixels=100).size == (10, 10)  # the limit itself is fine
    with pytest.raises(BadInput, match="10x10, more than 99 pixels"):
        decode_image(data, max_pixels=99)


def test_badinput_maps_to_invalid_argument():
    assert BadInput.code is grpc.StatusCode.INVALID_ARGUMENT


def test_content_id_is_the_sha256_hex_of_the_bytes():
    data = image_bytes("PNG")
    assert content_id(data) == hashlib.sha256(data).hexdigest()
    assert content_id(data) != content_id(data + b"\0")
    assert content_id(data, "") == hashlib.sha256(data).hexdigest()  # the empty namespace: as without one


def test_content_id_in_a_namespace_differs_per_namespace_and_from_the_empty_one():
    data = image_bytes("PNG")
    ids = {content_id(data, ns) for ns in ("", "a:", "b:", "a", "a:b:", "ab:")}
    assert len(ids) == 6
    assert content_id(data, "a:") == content_id(data, "a:")  # a tenant's second send is the same item
    assert content_id(data, "a:") != content_id(data + b"\0", "a:")
    # The namespace's length is hashed: moving bytes between namespace and data gives another identifier.
    assert content_id(b"x" + data, "a:") != content_id(data, "a:x")
    assert len(content_id(data, "a:")) == 64 and int(content_id(data, "a:"), 16) >= 0


def test_a_namespace_longer_than_a_tenant_s_is_refused():
    assert check_namespace("t" * 64 + ":") == "t" * 64 + ":"
    with pytest.raises(BadInput, match="at most 128"):
        check_namespace("t" * 129)


# --- formats and bombs -----------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP", "GIF", "BMP"])
def test_every_allowed_format_decodes(fmt):
    assert decode_image(image_bytes(fmt, size=(8, 6))).size == (8, 6)


@pytest.mark.parametrize("fmt", ["TIFF", "PPM", "ICO"])
def test_a_format_outside_the_allow_list_is_refused_though_pil_reads_it(fmt):
    with pytest.raises(BadInput, match="not a recognised image file"):
        decode_image(image_bytes(fmt, size=(8, 6)))


def test_a_decompression_bomb_is_refused_from_its_header_without_decoding():
    data = bomb_png(10000)  # ~12 KB claiming 100 M pixels
    # This refusal is raised from the header's size, before any pixel is loaded.
    with pytest.raises(BadInput, match="image is 10000x10000, more than"):
        decode_image(data)


# --- the service decoder: limits per request and per service --------------------------------------------


def _decoder(**kw) -> MediaDecoder:
    return MediaDecoder(MediaConfig(**{"decode_wait_s": 0.2, **kw}))


def test_the_decoder_decodes_off_the_event_loop_on_named_threads(monkeypatch):
    import services.common.media as media

    seen = []
    real = media.decode_image
    monkeypatch.setattr(media, "decode_image", lambda *a, **k: (seen.append(threading.current_thread().name),
                                                                 real(*a, **k))[1])
    dec = _decoder()

    async def main():
        images, lease = await dec.decode([image_bytes(size=(8, 6)), image_bytes(size=(4, 4))], 8)
        assert [im.size for im in images] == [(8, 6), (4, 4)] and all(im.mode == "RGB" for im in images)
        assert dec.budget.used == (48 + 16) * BYTES_PER_PIXEL  # held until the caller hands the images on
        lease.release()
        lease.release()  # idempotent
        assert dec.budget.used == 0

    asyncio.run(main())
    dec.close()
    assert len(seen) == 2 and all(name.startswith("epd-decode") for name in seen)


def test_more_images_than_max_images_are_refused_before_decoding():
    with pytest.raises(BadInput, match="3 images in one request; this service allows at most 2"):
        _decoder().check([image_bytes()] * 3, max_images=2)


def test_a_request_over_its_pixel_budget_is_invalid_argument():
    dec = _decoder(max_request_pixels=100)
    assert dec.check([image_bytes(size=(10, 5))] * 2, 8) == 100 * BYTES_PER_PIXEL  # exactly the limit
    with pytest.raises(BadInput, match="101 pixels together, more than the 100 allowed per request"):
        dec.check([image_bytes(size=(10, 5)), image_bytes(size=(51, 1))], 8)


def test_an_image_in_a_request_is_refused_by_format_and_header_naming_its_index():
    dec = _decoder(max_image_pixels=1000)
    with pytest.raises(BadInput, match="image 1: .*not a recognised image file"):
        dec.check([image_bytes(), image_bytes("TIFF")], 8)
    with pytest.raises(BadInput, match="image 0: image is 100x100"):
        dec.check([image_bytes(size=(100, 100))], 8)


def test_a_request_larger_than_the_whole_service_budget_is_refused_at_once():
    dec = _decoder(decode_budget_mib=1 / 1024)  # 1 KiB
    with pytest.raises(BadInput, match="more than this service decodes at once"):
        dec.check([image_bytes(size=(20, 20))], 8)  # 1600 bytes


async def _until(predicate, what: str, within_s: float = 10.0) -> None:
    """Polls ``predicate`` on the event loop until it holds; fails after ``within_s`` (a hang)."""
    deadline = time.monotonic() + within_s
    while not predicate():
        assert time.monotonic() < deadline, f"not {what} within {within_s}s"
        await asyncio.sleep(0.001)


def test_a_request_that_does_not_fit_the_busy_budget_waits_then_is_resource_exhausted():
    dec = _decoder(decode_budget_mib=1 / 1024, decode_wait_s=0.2)  # 1 KiB: one 16x16 image (1 KiB) at a time

    async def main():
        _, first = await dec.decode([image_bytes(size=(16, 16))], 8)
        refused = asyncio.create_task(dec.decode([image_bytes(size=(16, 16))], 8))
        await _until(lambda: dec.budget.waiting == 1 or refused.done(), "queued")
        assert dec.budget.waiting == 1  # it waits for room rather than being refused at once
        with pytest.raises(NoCapacity, match="did not fit within 0.2s"):
            await refused
        assert dec.budget.used == 1024 and dec.budget.waiting == 0  # the refused request holds nothing
        first.release()
        assert dec.budget.used == 0

    asyncio.run(main())
    dec.close()
    assert NoCapacity.code is grpc.StatusCode.RESOURCE_EXHAUSTED


def test_a_request_waiting_for_the_busy_budget_goes_ahead_once_room_is_released():
    dec = _decoder(decode_budget_mib=1 / 1024, decode_wait_s=60)  # the wait never runs out here

    async def main():
        _, first = await dec.decode([image_bytes(size=(16, 16))], 8)
        waiting = asyncio.create_task(dec.decode([image_bytes(size=(16, 16))], 8))
        await _until(lambda: dec.budget.waiting == 1, "queued")
        assert not waiting.done()
        first.release()  # room again: the waiting request goes ahead
        images, second = await waiting
        assert images[0].size == (16, 16) and dec.budget.used == 1024
        second.release()
        assert dec.budget.used == 0

    asyncio.run(main())
    dec.close()


def test_a_bad_image_gives_back_the_budget_it_took():
    dec = _decoder()

    async def main():
        good = image_bytes(size=(8, 8))
        truncated = image_bytes(size=(64, 64), noise=True)[:200]
        with pytest.raises(BadInput, match="image 1: image could not be decoded"):
            await dec.decode([good, truncated], 8)
        assert dec.budget.used == 0

    asyncio.run(main())
    dec.close()


def test_the_byte_budget_serves_waiters_first_come_first_served():
    async def main():
        budget = ByteBudget(10)
        assert await budget.acquire(8, 60)
        big = asyncio.create_task(budget.acquire(10, 60))
        await _until(lambda: budget.waiting == 1, "queued")
        small = asyncio.create_task(budget.acquire(2, 60))  # would fit now, but the big one came first
        await _until(lambda: budget.waiting == 2 or small.done(), "queued")
        assert budget.waiting == 2 and budget.used == 8 and not big.done() and not small.done()
        budget.release(8)  # grants synchronously, to the head of the queue only
        assert budget.used == 10 and budget.waiting == 1
        assert await big
        assert not small.done() and budget.waiting == 1
        budget.release(10)
        assert await small and budget.used == 2 and budget.waiting == 0

    asyncio.run(main())


def test_media_limits_are_validated():
    with pytest.raises(ValueError, match="max_request_pixels must be > 0"):
        MediaConfig(max_request_pixels=0)


# --- audio: header checks, the same budget, vLLM's decoder -----------------------------------------------


def test_audio_is_checked_from_its_header_and_charged_as_float32_samples():
    from services.common.media_checks import check_audio
    from tools.media import make_audio

    wav, flac = make_audio(0, 0.5), make_audio(1, 0.25, fmt="FLAC")
    assert check_audio(wav, 600) == ("WAV", 0.5, 8000 * 4)
    assert check_audio(flac, 600)[:2] == ("FLAC", 0.25)
    dec = _decoder(max_audio_seconds=0.4)
    assert dec.check_media("audio", [flac, flac], 2) == 2 * 4000 * 4
    with pytest.raises(BadInput, match="audio 1: audio is 0.5 s long, more than the 0.4 s allowed"):
        dec.check_media("audio", [flac, wav], 2)
    with pytest.raises(BadInput, match="3 audio items in one request; this service allows at most 2"):
        dec.check_media("audio", [flac] * 3, 2)
    with pytest.raises(BadInput, match="audio 0: audio is not a recognised audio file"):
        dec.check_media("audio", [image_bytes()], 2)
    with pytest.raises(BadInput, match="header cannot be read"):
        dec.check_media("audio", [b"RIFF\x24\x00\x00\x00WAVEfmt " + bytes(8)], 2)


def test_audio_decodes_with_vllms_decoder_and_gives_its_budget_back():
    import numpy as np

    from tools.media import make_audio

    dec = _decoder()
    clip = make_audio(3, 0.25)

    async def run():
        from vllm.multimodal.media.audio import AudioMediaIO

        clips, lease = await dec.decode_media("audio", [clip], 2, AudioMediaIO().load_bytes)
        assert dec.budget.used == 4000 * 4
        lease.release()
        return clips

    (samples, rate), = asyncio.run(run())
    assert rate == 16000 and samples.dtype == np.float32 and samples.shape == (4000,)
    assert dec.budget.used == 0
    dec.close()


def test_video_is_checked_from_its_container_header():
    from services.common.media_checks import VideoHeader, check_video
    from tools.media import make_video

    mp4 = make_video(0, frames=8, size=(64, 48), fps=4)
    header = check_video(mp4, 600, 10_000)
    assert header == VideoHeader("MP4", 8, 4.0, 64, 48) and header.seconds == 2.0
    # The budget is charged the frames the video loader will decode (its own sampling rule).
    assert _decoder().check_media("video", [mp4], 2) == 8 * 64 * 48 * 3
    assert _decoder().check_media("video", [mp4], 2, sampled_frames=lambda h: 4) == 4 * 64 * 48 * 3
    dec = _decoder(max_video_seconds=1.5)
    with pytest.raises(BadInput, match="video 0: video is 2.0 s long, more than the 1.5 s allowed"):
        dec.check_media("video", [mp4], 2)
    with pytest.raises(BadInput, match="video 0: video frames are 64x48, more than 1000 pixels"):
        _decoder(max_image_pixels=1000).check_media("video", [mp4], 2)
    with pytest.raises(BadInput, match="video 1: video is not a recognised video file"):
        _decoder().check_media("video", [mp4, image_bytes()], 2)
    with pytest.raises(BadInput, match="cannot be opened|holds no readable frames"):
        _decoder().check_media("video", [mp4[:200]], 2)


def test_the_encoder_charges_the_frames_vllms_video_loader_samples():
    """Qwen-VL's loaders sample by fps (2 per second, up to 768), the default one 32 frames: a long
    HD clip is charged what its decode allocates, not a guess."""
    from vllm.multimodal.media.image import ImageMediaIO
    from vllm.multimodal.media.video import VideoMediaIO

    from services.common.media_checks import VideoHeader
    from services.common.vllm_media import frames_sampled_by

    long_hd, short = VideoHeader("MP4", 12000, 30.0, 1920, 1080), VideoHeader("MP4", 8, 4.0, 64, 48)
    counts = {backend: frames_sampled_by(VideoMediaIO(ImageMediaIO(image_mode="RGB"), video_backend=backend))
              for backend in ("opencv", "qwen2_vl", "qwen3_vl")}
    assert [counts["opencv"](long_hd), counts["opencv"](short)] == [32, 8]
    assert [counts["qwen2_vl"](long_hd), counts["qwen2_vl"](short)] == [768, 4]
    # 768 sampled 1080p frames are 4.4 GiB: more than the default decode budget, so refused unread.
    assert long_hd.decoded_bytes(768) > _decoder().budget.capacity
