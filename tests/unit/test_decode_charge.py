"""An audio decode is charged its peak from the file's header before vLLM decodes a sample
(``services.common.decode_charge``), on every path that decodes: the encoder's speech windows
(``services.encoder.speech``), the encoder's chat audio (``services.common.vllm_media.decode_audio``), the
LM's chat audio (``services.lm.media.RequestMedia``) and the LM's own speech-to-text serving
(``services.lm.speech.guard_servings``). The file that shows why: 349 s of silence at 192 kHz, a 206 KB
FLAC whose decode and resample peaked at 1.85 GB in vLLM's path."""

from __future__ import annotations

import asyncio
import io
from types import SimpleNamespace

import numpy as np
import pytest
import soundfile

from services.common.budget import ByteBudget, DecodeLease
from services.common.decode_charge import (
    PYAV_COPIES,
    AudioRefused,
    chat_charge,
    read_header,
    speech_charge,
)
from services.common.errors import BadInput
from services.common.media import MediaConfig, MediaDecoder
from tools.media import make_audio

pytestmark = pytest.mark.unit

MIB = 1 << 20
VLLM_DECODE_BYTES = 256 * MIB  # vLLM's VLLM_MAX_AUDIO_DECODE_BYTES default


@pytest.fixture(scope="module")
def bomb() -> bytes:
    """349 s of silence at 192 kHz, mono FLAC: about 206 KB; 268 MB of float32 at its own rate, just under
    vLLM's 256 MiB decode bound, so vLLM's own header check lets it through."""
    buf = io.BytesIO()
    with soundfile.SoundFile(buf, "w", samplerate=192_000, channels=1, format="FLAC", subtype="PCM_16") as f:
        second = np.zeros(192_000, dtype=np.int16)
        for _ in range(349):
            f.write(second)
    return buf.getvalue()


def test_a_small_high_rate_file_is_charged_its_decode_and_resample_not_its_size(bomb):
    assert len(bomb) < 256 * 1024
    charge = speech_charge(bomb, 16_000, 600, VLLM_DECODE_BYTES)
    # the samples at the file's own rate (268 MB), then PyAV's resample of them to 16 kHz
    assert charge.nbytes > 349 * 192_000 * 4 * 6 and "192000 Hz" in charge.basis
    assert charge.refusal(1024 * MIB, 1024) is not None  # the default budget cannot hold it
    assert chat_charge(bomb, 16_000, 600, VLLM_DECODE_BYTES).nbytes > charge.nbytes  # torchaudio takes more


def test_a_clip_at_the_models_rate_is_charged_its_samples_only():
    clip = make_audio(seed=1, seconds=2.0, rate=16_000)
    assert speech_charge(clip, 16_000, 600, VLLM_DECODE_BYTES).nbytes == 2 * 32_000 * 4
    assert chat_charge(clip, 16_000, 600, VLLM_DECODE_BYTES).nbytes == 32_000 * 4
    stereo = make_audio(seed=1, seconds=2.0, rate=48_000, channels=2)
    assert read_header(stereo).channels == 2
    # read (2 channels) and mixed, then resampled from the 96 000-frame mix to 32 000 frames
    mono, out = 96_000 * 4, 32_000 * 4
    assert speech_charge(stereo, 16_000, 600, VLLM_DECODE_BYTES).nbytes == mono + 6 * (mono + out) + out


def test_vllms_own_header_rules_refuse_before_any_charge():
    clip = make_audio(seed=1, seconds=3.0, rate=16_000, fmt="FLAC")
    with pytest.raises(AudioRefused, match="maximum allowed duration of 2"):
        speech_charge(clip, 16_000, 2, VLLM_DECODE_BYTES)
    with pytest.raises(AudioRefused, match="VLLM_MAX_AUDIO_DECODE_BYTES"):
        chat_charge(clip, 16_000, 600, 1000)


def test_a_file_libsndfile_cannot_read_is_charged_pyavs_whole_bound():
    """vLLM hands what libsndfile cannot open (an M4A, a WebM) to PyAV, whose length nobody can trust:
    the charge is PyAV's bound at the output rate, times the copies vLLM's loader makes."""
    bound = 600 * 16_000 * 4
    assert speech_charge(b"\x00\x00\x00\x20ftypM4A " + bytes(64), 16_000, 600, VLLM_DECODE_BYTES).nbytes \
        == (PYAV_COPIES + 1) * bound
    with pytest.raises(AudioRefused):  # chat audio must be a format libsndfile reads
        chat_charge(b"not audio" * 10, 16_000, 600, VLLM_DECODE_BYTES)


def test_a_lease_keeps_only_what_the_decode_left():
    budget = ByteBudget(1000)
    assert asyncio.run(budget.acquire(800, 0))
    lease = DecodeLease(budget, 800)
    lease.keep(300)
    assert budget.used == 300 and lease.nbytes == 300
    lease.keep(500)  # never grows
    assert budget.used == 300
    lease.release()
    assert budget.used == 0


# -- the encoder ----------------------------------------------------------------------------------------

vllm_serving = pytest.importorskip("vllm.entrypoints.speech_to_text.base.serving")


class _Decodes:
    """Records the calls of vLLM's ``_decode_and_chunk_speech`` (standing in for it, or passing through)."""

    def __init__(self, real=None) -> None:
        self.calls, self.real = 0, real

    def __call__(self, holder, audio):
        self.calls += 1
        if self.real is None:
            raise AssertionError("decoded")
        return self.real(holder, audio)


def _speech():
    """``SpeechWindows`` for Whisper's config (30 s windows at 16 kHz) under vLLM's default bounds."""
    from vllm.config.speech_to_text import SpeechToTextConfig

    from services.encoder.speech import SpeechWindows

    s = SpeechWindows.__new__(SpeechWindows)
    s._holder = SimpleNamespace(asr_config=SpeechToTextConfig(max_audio_clip_s=30, sample_rate=16000),
                                max_audio_decode_duration_s=600, max_audio_decode_bytes=VLLM_DECODE_BYTES)
    s.rate = 16000
    return s


def test_the_encoder_refuses_a_decoder_bomb_upload_before_decoding_it(bomb, monkeypatch):
    decodes = _Decodes()
    monkeypatch.setattr(vllm_serving.SpeechToTextBaseServing, "_decode_and_chunk_speech", decodes)
    decoder = MediaDecoder(MediaConfig())  # the default 1024 MiB budget
    assert asyncio.run(_speech().read(bomb, decoder, "r")) == (None, None)  # the LM reads it, under its budget
    assert decodes.calls == 0 and decoder.budget.used == 0


def test_the_encoder_holds_an_uploads_charge_while_its_windows_are_held(monkeypatch):
    decodes = _Decodes(vllm_serving.SpeechToTextBaseServing._decode_and_chunk_speech)
    monkeypatch.setattr(vllm_serving.SpeechToTextBaseServing, "_decode_and_chunk_speech", decodes)
    speech, decoder = _speech(), MediaDecoder(MediaConfig())
    clip = make_audio(seed=2, seconds=2.0, rate=48_000)
    windows, lease = asyncio.run(speech.read(clip, decoder, "r"))
    assert decodes.calls == 1 and [len(w) for w in windows.samples] == [32_000]
    assert decoder.budget.used == lease.nbytes == speech.charge(clip).nbytes
    lease.release()
    assert decoder.budget.used == 0


def test_the_encoder_refuses_a_decoder_bomb_chat_clip_before_decoding_it(bomb):
    from services.common.vllm_media import decode_audio

    decoded = []
    decoder = MediaDecoder(MediaConfig())
    with pytest.raises(BadInput, match="at its peak"):
        asyncio.run(decode_audio(decoder, [bomb], 1, decoded.append, 16_000, "r"))
    assert not decoded and decoder.budget.used == 0


# -- the LM -----------------------------------------------------------------------------------------------

def test_the_lm_refuses_a_decoder_bomb_chat_clip_before_decoding_it(bomb):
    from services.lm.media import RequestMedia

    decoded = []
    media = RequestMedia(MediaDecoder(MediaConfig()), "r", "t:", audio_rate=16_000)
    with pytest.raises(BadInput, match="more than this service decodes at once"):
        asyncio.run(media.load("audio", bomb, decoded.append))
    assert not decoded and media.decoder.budget.used == 0


def _serving(decode):
    """What ``guard_servings`` reads of vLLM's speech-to-text serving, with ``decode`` as its decoder."""
    from vllm.config.speech_to_text import SpeechToTextConfig

    return SimpleNamespace(asr_config=SpeechToTextConfig(max_audio_clip_s=30, sample_rate=16000),
                           max_audio_decode_duration_s=600, max_audio_decode_bytes=VLLM_DECODE_BYTES,
                           _decode_and_chunk_speech=decode, _decode_and_chunk_speech_async=None,
                           renderer=SimpleNamespace(), engine_client=SimpleNamespace())


def _in_call(coro_fn, media):
    """``coro_fn()`` run as vLLM's serving runs inside a Generate call (``CURRENT`` set in its task)."""
    from services.lm.context import CURRENT, RequestContext

    async def go():
        ctx = RequestContext(media=media)
        CURRENT.set(ctx)
        try:
            return await coro_fn(), ctx
        except Exception as e:  # noqa: BLE001 - the test reads what the call was refused with
            return e, ctx
    return asyncio.run(go())


def test_the_lms_speech_serving_refuses_a_decoder_bomb_before_decoding_it(bomb):
    from services.lm.media import RequestMedia
    from services.lm.speech import guard_servings

    decoded = []
    serving = _serving(lambda audio: decoded.append(audio))
    guard_servings(SimpleNamespace(openai_serving_transcription=serving))
    media = RequestMedia(MediaDecoder(MediaConfig()), "r", "t:")
    refused, ctx = _in_call(lambda: serving._decode_and_chunk_speech_async(bomb), media)
    # a ValueError, which vLLM's serving answers 400 as it answers its own decode bounds
    assert isinstance(refused, AudioRefused) and "at its peak" in str(refused) and ctx.failure is None
    assert not decoded and media.decoder.budget.used == 0


def test_the_lms_speech_serving_keeps_the_windows_charged_until_the_call_ends():
    from services.lm.media import RequestMedia
    from services.lm.speech import guard_servings

    windows = [np.zeros(16_000, dtype=np.float32), np.zeros(8_000, dtype=np.float32)]
    serving = _serving(lambda audio: (windows, 1.5))
    guard_servings(SimpleNamespace(openai_serving_translation=serving))
    media = RequestMedia(MediaDecoder(MediaConfig()), "r", "")
    (got, seconds), _ = _in_call(lambda: serving._decode_and_chunk_speech_async(make_audio(seed=3, rate=48_000)),
                                 media)
    assert got is windows and seconds == 1.5 and media.decoder.budget.used == 24_000 * 4
    media.release()
    assert media.decoder.budget.used == 0
