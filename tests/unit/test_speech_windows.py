"""Issue 35's speech windows, piece by piece: the window's identifier (``services.common.media.window_id``),
the encoder's reading of an upload (``services.encoder.speech``), the LM's naming of every window in the
request's namespace (``services.lm.speech``) and the gateway's reading of the encoder's window
metadata (``services.gateway.encoding.Encodes._events``). The whole path is tests/e2e/test_transcriptions.py."""

from __future__ import annotations

import asyncio
import io
from types import SimpleNamespace

import numpy as np
import pytest
import soundfile

from epd.encoder.v1 import encoder_pb2
from epd.lm.v1 import lm_pb2
from epd.transfer.v1 import transfer_pb2
from services.common.media import content_id, window_id, window_wav
from services.gateway.encoding import MAX_WINDOWS, EncodeGroup, Encodes
from services.gateway.request import multipart_upload, upload_key
from services.gateway.values import Timings
from tools.media import make_audio

pytestmark = pytest.mark.unit


def _samples(seconds: float, seed: int = 0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(int(16000 * seconds)) * 0.1).astype(np.float32)


def test_a_window_is_named_by_a_float_wav_of_its_samples():
    x = _samples(0.5)
    data = window_wav(x, 16000)
    y, rate = soundfile.read(io.BytesIO(data), dtype="float32")
    assert rate == 16000 and np.array_equal(x, y) and soundfile.info(io.BytesIO(data)).subtype == "FLOAT"
    assert window_id(x, 16000) == content_id(data)
    assert window_id(x, 16000, "t:") == content_id(data, "t:") != window_id(x, 16000)
    assert window_id(x.astype(np.float64), 16000) == window_id(x, 16000)  # the samples, not their array type
    y = x.copy()
    y[100] += 1e-6
    assert window_id(y, 16000) != window_id(x, 16000)


def test_the_gateway_routes_an_upload_by_its_file_not_by_its_form():
    """The routing key of a speech upload: the same clip is one key (the encoder that holds its windows gets
    it again) whatever the boundary, the field order or the other fields; a body without a file part is
    keyed whole."""
    import httpx

    clip = make_audio(seed=1, seconds=1.0)
    a, ctype_a = multipart_upload({"model": "m", "language": "en"}, clip)
    b, ctype_b = multipart_upload({"temperature": 0, "language": "fr", "model": "m"}, clip)
    assert ctype_a != ctype_b and upload_key(a, ctype_a) == upload_key(b, ctype_b) == content_id(clip)
    assert upload_key(a, ctype_a, "t:") == content_id(clip, "t:")
    sent = httpx.Request("POST", "http://gateway/", files={"file": ("c.wav", clip, "audio/wav")}, data={"model": "m"})
    assert upload_key(sent.read(), sent.headers["content-type"]) == content_id(clip)
    assert upload_key(b"no parts", "multipart/form-data; boundary=zz") == content_id(b"no parts")
    assert upload_key(a, "application/json") == content_id(a)


# -- the encoder's reading of an upload ---------------------------------------------------------------

vllm_serving = pytest.importorskip("vllm.entrypoints.speech_to_text.base.serving")


def _speech():
    """``SpeechWindows`` for Whisper's config (30 s windows at 16 kHz), without a model."""
    from vllm.config.speech_to_text import SpeechToTextConfig

    from services.encoder.speech import SpeechWindows

    s = SpeechWindows.__new__(SpeechWindows)
    s._holder = SimpleNamespace(asr_config=SpeechToTextConfig(max_audio_clip_s=30, sample_rate=16000),
                                max_audio_decode_duration_s=120, max_audio_decode_bytes=1 << 30)
    s.rate = 16000
    return s


def test_the_encoder_reads_the_file_part_as_vllms_app_does():
    speech = _speech()
    clip = make_audio(seed=1, seconds=1.0)
    body, ctype = multipart_upload({"model": "m", "language": "en"}, clip)
    assert asyncio.run(speech.file_part(body, ctype)) == clip
    # Two parts named "file": the last one, as FastAPI's form model takes a non-list field.
    other = make_audio(seed=2, seconds=1.0)
    boundary = ctype.split("boundary=")[1].encode()
    second = (b"--" + boundary + b'\r\nContent-Disposition: form-data; name="file"; filename="b"\r\n\r\n'
              + other + b"\r\n")
    assert asyncio.run(speech.file_part(body.replace(b"--" + boundary + b"--", second + b"--" + boundary + b"--"),
                                        ctype)) == other
    # What vLLM's app refuses is left to it: no form, no file, a field where the file should be.
    assert asyncio.run(speech.file_part(b'{"model": "m"}', "application/json")) is None
    assert asyncio.run(speech.file_part(body, "multipart/form-data; boundary=other")) is None
    plain = body.replace(b'name="file"; filename="audio"\r\nContent-Type: application/octet-stream', b'name="file"')
    assert asyncio.run(speech.file_part(plain, ctype)) is None


def test_the_encoder_cuts_the_windows_vllms_serving_cuts():
    speech = _speech()
    short = speech.cut(make_audio(seed=3, seconds=2.0))
    assert short.rate == 16000 and [len(w) for w in short.samples] == [32000]
    long = speech.cut(make_audio(seed=3, seconds=45.0))
    assert len(long.samples) == 2 and sum(len(w) for w in long.samples) >= 45 * 16000
    assert all(len(w) <= 30 * 16000 for w in long.samples)
    assert speech.cut(b"not audio at all" * 40) is None
    assert speech.cut(make_audio(seed=4, seconds=130.0)) is None  # past the decode bound: vLLM refuses it


# -- the LM's naming of the window it is about to encode ------------------------------------------------

def _window_prompt(x):
    return {"encoder_prompt": {"prompt": "", "multi_modal_data": {"audio": (x, 16000)}},
            "decoder_prompt": {"prompt": "<|startoftranscript|>"}}


def _tenant(namespace: str, sources=()):
    from services.common.media import MediaConfig, MediaDecoder
    from services.lm.context import RequestContext
    from services.lm.media import RequestMedia

    ctx = RequestContext(media=RequestMedia(MediaDecoder(MediaConfig()), "r", namespace))
    ctx.sources.update({ident: object() for ident in sources})
    return ctx


def test_the_lm_names_every_window_by_its_samples_in_the_requests_namespace():
    from services.lm.speech import mm_hashes, name_windows

    a, b = _samples(1.0, 1), _samples(1.0, 2)
    ctx = _tenant("t:", [window_id(a, 16000, "t:")])
    named = name_windows(_window_prompt(a), ctx)
    assert named["encoder_prompt"]["multi_modal_uuids"] == {"audio": [window_id(a, 16000, "t:")]}  # the encoder's
    assert named["decoder_prompt"] == _window_prompt(a)["decoder_prompt"]
    # A window no encoder cut is encoded on the LM: still named in the tenant's namespace, never by vLLM's hash.
    assert name_windows(_window_prompt(b), ctx)["encoder_prompt"]["multi_modal_uuids"] == \
        {"audio": [window_id(b, 16000, "t:")]}
    assert name_windows({"prompt": "text"}, ctx) == {"prompt": "text"}
    given = _window_prompt(a)
    given["encoder_prompt"]["multi_modal_uuids"] = {"audio": ["x"]}
    assert name_windows(given, ctx) is given  # vLLM's own naming stands
    assert mm_hashes({"type": "enc_dec", "encoder_prompt": {"prompt_token_ids": []},
                       "decoder_prompt": {"mm_hashes": {"audio": ["h1"]}}}) == {"h1"}
    assert mm_hashes({"prompt": "x"}) == set()


def test_two_tenants_same_clip_gets_two_window_identifiers_on_every_lm_path():
    """The windows vLLM's serving renders and the language detection's first window, which it submits to the
    engine unrendered: each named in its request's namespace before vLLM would hash its samples alone."""
    from services.lm.context import CURRENT
    from services.lm.speech import guard_servings

    seen = []

    class Renderer:
        async def render_cmpl_async(self, prompts, *args, **kwargs):
            seen.extend(p["encoder_prompt"]["multi_modal_uuids"]["audio"][0] for p in prompts)
            return prompts

    class Engine:
        def generate(self, prompt, params, request_id):
            seen.append(prompt["encoder_prompt"]["multi_modal_uuids"]["audio"][0])

    serving = SimpleNamespace(asr_config=SimpleNamespace(sample_rate=16000), renderer=Renderer(),
                              engine_client=Engine(), _decode_and_chunk_speech=None)
    guard_servings(SimpleNamespace(openai_serving_transcription=serving))
    clip = _samples(1.0, 3)

    async def call(namespace):
        CURRENT.set(_tenant(namespace))
        serving.engine_client.generate(_window_prompt(clip), None, "lang")  # vLLM's _detect_language
        await serving.renderer.render_cmpl_async([_window_prompt(clip)])

    for namespace in ("tenant:a:", "tenant:b:"):
        asyncio.run(call(namespace))
    assert seen == [window_id(clip, 16000, "tenant:a:")] * 2 + [window_id(clip, 16000, "tenant:b:")] * 2
    assert seen[0] != seen[2]


# -- the gateway's reading of the encoder's window metadata ---------------------------------------------

class _Stream:
    def __init__(self, events):
        self.events = events

    def __aiter__(self):
        return self._gen()

    async def _gen(self):
        for e in self.events:
            yield e


def _window(w: int, n: int, ident: str) -> encoder_pb2.EncodeEvent:
    src = transfer_pb2.ItemSource(transfer_endpoint="e:1", num_embeds=1500, embed_width=4)
    return encoder_pb2.EncodeEvent(metadata=encoder_pb2.ItemMetadata(identifier=ident, index=0, modality="audio",
                                                                     window=w, windows=n, source=src))


def _run(events, n_items: int = 1):
    async def go():
        req = lm_pb2.GenerateRequest()
        req.items.add(modality="audio", identifier="upload")
        g = EncodeGroup(SimpleNamespace(address="enc"), [0])
        await Encodes._events(g, _Stream(events), req, Timings(), n_items)
        return req, g.metadata.done()
    return asyncio.run(go())


def _encoded(ident: str) -> encoder_pb2.EncodeEvent:
    return encoder_pb2.EncodeEvent(encoded=encoder_pb2.ItemEncoded(identifier=ident, index=0))


def test_the_gateway_makes_each_window_an_item():
    req, done = _run([_window(0, 2, "w0"), _window(1, 2, "w1"), _encoded("w0"), _encoded("w1")])
    assert done and [(i.identifier, i.HasField("source")) for i in req.items] == [("w0", True), ("w1", True)]
    req, done = _run([_window(0, 1, "w0"), _encoded("w0")])
    assert done and [i.identifier for i in req.items] == ["w0"]


def test_an_upload_the_encoder_leaves_to_the_lm_keeps_its_item_without_a_source():
    req, done = _run([encoder_pb2.EncodeEvent(metadata=encoder_pb2.ItemMetadata(index=0, modality="audio"))])
    assert done and [(i.identifier, i.HasField("source")) for i in req.items] == [("upload", False)]


@pytest.mark.parametrize("events", [
    [_window(2, 2, "w")],  # a window past the count
    [_window(0, 2, "w0"), _window(1, 3, "w1")],  # two counts for one upload
    [_window(0, MAX_WINDOWS + 1, "w")],  # more than an upload may become
    [_window(0, 2, "w0"), _window(1, 2, "w1"), _encoded("w0")],  # a window never encoded
])
def test_window_metadata_that_does_not_add_up_fails_the_encoder(events):
    import grpc

    with pytest.raises(grpc.aio.AioRpcError):
        _run(events)
