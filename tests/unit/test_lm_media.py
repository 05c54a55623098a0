"""What the LM accepts in a request's media parts (services.lm.servicer.check_media): uuid-only
parts of items an encoder has, or data: URLs whose uuid is their content hash; and the video headers
it reads before vLLM decodes a video it encodes itself."""

from __future__ import annotations

import asyncio
import base64
import hashlib

import pytest

from epd.lm.v1 import lm_pb2
from services.common.errors import BadInput
from services.common.images import make_audio, make_video
from services.lm.servicer import check_media, check_videos

pytestmark = pytest.mark.unit


def _body(*parts) -> dict:
    return {"messages": [{"role": "user", "content": [*parts, {"type": "text", "text": "hi"}]}]}


def _url(data: bytes, mime: str) -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def test_media_parts_of_every_modality_are_checked_and_videos_returned():
    wav, mp4 = make_audio(1, 0.2), make_video(2, frames=4)
    src = lm_pb2.MMItem(identifier="enc-1", source=lm_pb2.ItemSource(transfer_endpoint="e:1"))
    videos = check_media(_body({"type": "audio_url", "audio_url": None, "uuid": "enc-1"},
                               {"type": "audio_url", "audio_url": {"url": _url(wav, "audio/wav")},
                                "uuid": hashlib.sha256(wav).hexdigest()},
                               {"type": "video_url", "video_url": {"url": _url(mp4, "video/mp4")}}), {"enc-1": src})
    assert videos == [mp4]
    asyncio.run(check_videos(videos))
    with pytest.raises(BadInput, match="audio 'other'... has no data and no encoder"):
        check_media(_body({"type": "audio_url", "audio_url": None, "uuid": "other"}), {"enc-1": src})
    with pytest.raises(BadInput, match="video uuid 'x'... is not the content hash"):
        check_media(_body({"type": "video_url", "video_url": {"url": _url(mp4, "video/mp4")}, "uuid": "x"}), {})
    with pytest.raises(BadInput, match="takes video items as data: URLs only"):
        check_media(_body({"type": "video_url", "video_url": {"url": "http://x/v.mp4"}}), {})
    with pytest.raises(BadInput, match="content part type 'input_audio' is not served here"):
        check_media(_body({"type": "input_audio", "input_audio": {"data": "AA==", "format": "wav"}}), {})


def test_a_video_the_lm_would_decode_is_refused_by_its_header():
    with pytest.raises(BadInput, match="video 0: video is not a recognised video file"):
        asyncio.run(check_videos([b"not a video at all"]))
