"""What decoding one audio file costs at its peak, read from its header before anything is decoded: the
charge a service takes from its decode budget (``services.common.budget``) before it lets vLLM's loader run.

vLLM 0.32 decodes audio in two places, both with ``load_audio`` (backend "auto": torchcodec where it is
installed, else soundfile, else PyAV for what libsndfile cannot open):

- a speech upload (``speech_charge``): the speech-to-text serving decodes the file at its own rate, mixes it
  to mono and resamples it to the model's rate in one go (``sr=rate``; the encoder's ``SpeechWindows.cut``
  and the LM's vLLM app both run it);
- a chat item (``chat_charge``): ``AudioMediaIO.load_bytes`` decodes at the file's own rate (``sr=None``),
  and the model's processor then resamples it to its rate while the charge is still held.

Where libsndfile reads the header (every format the gateway accepts), soundfile allocates exactly what it
says: ``frames x channels x 4`` bytes of float32, then the mono mix (``frames x 4``, which replaces it),
then the resampler, whose working memory is measured, not derived (peak RSS over the resample of 2 to 10
minutes of audio at 8 to 192 kHz): PyAV's (the serving's resample of the whole clip in one frame) took up
to 5.8 times its input and output together, torchaudio's (the processor's) up to 13.2 (192 kHz to 16 kHz;
44.1 kHz to 16 kHz took 1.9). A 206 KB FLAC of 349 s of silence at 192 kHz is charged 2.0 GB here; it
peaked at 1.85 GB in vLLM's path. The charge is an upper bound by design: it is what lets a service refuse
the file before it decodes a sample.

Where libsndfile cannot read it (an MP4, M4A or WebM upload), vLLM's auto path hands the file to PyAV,
whose container says nothing we can trust about length: the charge is then PyAV's own bound (the
resampled samples up to the duration bound, at most ``max_decode_bytes``) times the copies vLLM makes of
them (the decoded chunks, their concatenation, the float32 cast, the mono mix).

torchcodec, where installed, decodes and resamples in C++ at the output rate, within these charges. No
state, no I/O but reading the given bytes; blocking (libsndfile parses the container): services call it
on a decode thread.
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass

F32 = 4
"""Bytes per decoded sample: every vLLM audio loader produces float32."""
SERVING_RESAMPLE_WORK = 6
"""Peak bytes of PyAV's one-frame resample (``resample_audio_pyav``, the speech-to-text serving's) per byte
of its input plus output, its output included: up to 5.8 measured."""
PROCESSOR_RESAMPLE_WORK = 14
"""The same for vLLM's processor's resampler (``AudioResampler``, torchaudio by default): up to 13.2 measured."""
PYAV_COPIES = 4
"""Copies of the decoded samples ``load_audio_pyav`` holds at once at worst: its chunks, their concatenation,
the float32 cast and the mono mix."""


class AudioRefused(ValueError):
    """vLLM's loader would refuse the file from its header (longer than its duration bound, or more decoded
    bytes than ``VLLM_MAX_AUDIO_DECODE_BYTES``), worded as vLLM words it. A ValueError, as vLLM's: its
    speech-to-text serving answers it 400."""


@dataclass(frozen=True)
class AudioHeader:
    """What libsndfile reads from a file's header (``soundfile.info``); nothing decoded."""

    frames: int
    rate: int
    channels: int

    @property
    def seconds(self) -> float:
        return self.frames / self.rate

    def out_frames(self, rate: int) -> int:
        """Frames of the clip resampled to ``rate``."""
        return self.frames if rate == self.rate else math.ceil(self.frames * rate / self.rate)


@dataclass(frozen=True)
class AudioCharge:
    """One file's decode charge: ``nbytes`` at its peak, and what it was read from (for messages)."""

    nbytes: int
    basis: str

    def refusal(self, capacity: int, budget_mib: float) -> str | None:
        """Why a service with a decode budget of ``capacity`` bytes must refuse the file, or None."""
        if self.nbytes <= capacity:
            return None
        return (f"audio decodes to {self.nbytes / (1 << 20):.0f} MiB at its peak ({self.basis}), more than this "
                f"service decodes at once ({budget_mib:g} MiB, --decode-budget-mib); refused before decoding")


def read_header(data: bytes) -> AudioHeader | None:
    """The file's header as libsndfile reads it, or None where libsndfile cannot (vLLM's loader then
    tries PyAV) or the header holds no samples."""
    try:
        import soundfile

        info = soundfile.info(io.BytesIO(data))
    except Exception:  # noqa: BLE001 - libsndfile raises several types for what it cannot read
        return None
    if info.frames <= 0 or info.samplerate <= 0 or info.channels <= 0:
        return None
    return AudioHeader(int(info.frames), int(info.samplerate), int(info.channels))


def vllm_refusal(header: AudioHeader, max_seconds: float, max_decode_bytes: int) -> AudioRefused | None:
    """What vLLM's soundfile loader says, from the same header, before it allocates anything."""
    if header.seconds > max_seconds:
        return AudioRefused(f"Audio exceeds maximum allowed duration of {max_seconds}s (file contains "
                            f"{header.seconds:.1f}s at {header.rate}Hz). Set VLLM_MAX_AUDIO_DECODE_DURATION_S "
                            "to increase this limit.")
    decoded = header.frames * header.channels * F32
    if decoded > max_decode_bytes:
        return AudioRefused(f"Audio would allocate {decoded / (1 << 20):.0f} MiB of PCM ({header.frames} frames x "
                            f"{header.channels} channels x 4B), exceeding the {max_decode_bytes / (1 << 20):.0f} "
                            "MiB limit. Set VLLM_MAX_AUDIO_DECODE_BYTES to increase this limit.")
    return None


def speech_charge(data: bytes, rate: int, max_seconds: float, max_decode_bytes: int) -> AudioCharge:
    """The peak of the speech-to-text serving's decode of ``data`` to mono at ``rate`` (the model's), with
    the windows it is cut into. Raises AudioRefused where vLLM refuses it from the header."""
    header = read_header(data)
    if header is None:
        bound = min(max_decode_bytes, int(rate * max_seconds) * F32)
        return AudioCharge(PYAV_COPIES * bound + bound, "no header libsndfile reads: PyAV's decode bound")
    if (refused := vllm_refusal(header, max_seconds, max_decode_bytes)) is not None:
        raise refused
    mono, out = header.frames * F32, header.out_frames(rate) * F32
    resampled = mono + SERVING_RESAMPLE_WORK * (mono + out) if rate != header.rate else mono
    return AudioCharge(max(_read(header), resampled) + out, _basis(header))


def chat_charge(data: bytes, target_rate: int | None, max_seconds: float, max_decode_bytes: int) -> AudioCharge:
    """The peak of ``AudioMediaIO.load_bytes`` on ``data`` and of the processor's resample of the result to
    ``target_rate`` (the model's processor's; None where the caller cannot know it: a resample to at most
    the file's own rate is charged). Raises AudioRefused where vLLM refuses the file from its header, and
    for a file libsndfile cannot read (the services take chat audio in the formats it reads)."""
    header = read_header(data)
    if header is None:
        raise AudioRefused("Invalid or unsupported audio file.")
    if (refused := vllm_refusal(header, max_seconds, max_decode_bytes)) is not None:
        raise refused
    mono = header.frames * F32
    out = header.out_frames(target_rate) * F32 if target_rate else mono
    resampled = mono + PROCESSOR_RESAMPLE_WORK * (mono + out) if target_rate != header.rate else mono
    return AudioCharge(max(_read(header), resampled), _basis(header))


def _read(header: AudioHeader) -> int:
    """soundfile's float32 read and, for more than one channel, the mono mix made from it (the mix, which
    the resampler reads, outlives the read: that is the ``frames x 4`` the other stages start from)."""
    return header.frames * header.channels * F32 + (header.frames * F32 if header.channels > 1 else 0)


def _basis(header: AudioHeader) -> str:
    return f"{header.seconds:.1f} s at {header.rate} Hz x {header.channels} channel(s), by its header"
