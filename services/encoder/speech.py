"""A speech-to-text upload cut into the windows vLLM's own serving cuts: the encoder's half of
``POST /v1/audio/transcriptions`` and ``/translations`` for an encoder-decoder model (Whisper-class).

The gateway hands the encoder the upload's whole body as the client sent it (``MediaItem.
upload_content_type``); the LM's copy of vLLM's app reads the same body. Both read it by vLLM's rule, with
vLLM's code, so the windows the encoder encodes are the windows the LM's vLLM asks for:

- the form is parsed by Starlette's ``Request.form()``, which FastAPI calls for vLLM's ``Form()`` request
  model, with its defaults; the audio is the form's ``file`` value as FastAPI takes it for a non-list
  field (``FormData.get``: the last part of that name), read by vLLM's ``read_upload_with_limit``;
- the audio is decoded and cut by vLLM's ``SpeechToTextBaseServing._decode_and_chunk_speech`` (its
  decoder, the model's speech-to-text config, its duration and size bounds, its quiet-point splitting),
  called on a holder with the attributes it reads;
- each window is named by its samples (``services.common.media.window_id``), the rule the LM names the
  window by before vLLM encodes it (``services.lm.frontend``).

Before a sample is decoded, the decode's peak is read from the file's header
(``services.common.decode_charge.speech_charge``: the file's own rate, channels and length, and the
resampler's working memory) and taken from the encoder's decode budget. An upload this cannot read (not a
form, no file, too big, not audio), one vLLM refuses from its header, or one whose decode would not fit the
whole budget gets no windows: the LM then reads it itself, under its own budget, and answers as `vllm serve`
does (its error included); the encoder never answers for vLLM. Windows are float32 arrays this module
returns to the caller with the budget they hold (a ``DecodeLease``), who hands them to vLLM's processor,
drops them and releases the lease.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from types import SimpleNamespace

from starlette.datastructures import UploadFile
from starlette.requests import Request
from vllm.entrypoints.speech_to_text.base.serving import SpeechToTextBaseServing
from vllm.entrypoints.speech_to_text.base.utils import read_upload_with_limit

from services.common.budget import DecodeLease
from services.common.decode_charge import AudioCharge, AudioRefused, speech_charge
from services.common.errors import BadInput
from services.common.media import MediaDecoder

logger = logging.getLogger(__name__)


@dataclass
class Windows:
    """An upload's audio as vLLM's serving cuts it: the windows (float32 arrays at ``rate``), in order."""

    samples: list
    rate: int


class SpeechWindows:
    """Cuts uploads for one model, under vLLM's decode bounds (``VLLM_MAX_AUDIO_DECODE_DURATION_S``, which
    the encoder and the LM set from their ``--max-audio-seconds`` unless the operator set it)."""

    def __init__(self, model_config) -> None:
        import vllm.envs as envs
        from vllm.model_executor.model_loader import get_model_cls

        model_cls = get_model_cls(model_config)
        # vLLM's serving holds the config of its own task; the windows depend on the clip length, the rate,
        # the overlap and the split window, which Whisper-class models give both tasks alike.
        self._holder = SimpleNamespace(
            asr_config=model_cls.get_speech_to_text_config(model_config, "transcribe"),
            max_audio_decode_duration_s=envs.VLLM_MAX_AUDIO_DECODE_DURATION_S,
            max_audio_decode_bytes=envs.VLLM_MAX_AUDIO_DECODE_BYTES)
        self.rate = int(self._holder.asr_config.sample_rate)

    def charge(self, audio: bytes) -> AudioCharge:
        """The peak of ``cut(audio)``, from the file's header (blocking: run it on a decode thread). Raises
        AudioRefused where vLLM's decoder refuses the file from its header."""
        return speech_charge(audio, self.rate, self._holder.max_audio_decode_duration_s,
                             self._holder.max_audio_decode_bytes)

    async def read(self, audio: bytes, decoder: MediaDecoder, rid: str) -> tuple[Windows | None, DecodeLease | None]:
        """``audio``'s windows, decoded under ``decoder``'s budget after its header charge was taken, and the
        lease the caller releases once the windows are processed; (None, None), with nothing decoded, where
        vLLM refuses the file from its header or its decode would not fit the whole budget, and where the
        decode fails or outlives ``--decode-timeout-s`` (the LM reads the upload itself then). Raises
        NoCapacity where the charge found no room in time."""
        try:
            (charge,) = await decoder.run_all([functools.partial(self.charge, audio)], "audio header")
        except (AudioRefused, BadInput) as e:
            logger.info("request %s: %s; the LM reads the upload itself", rid, str(e)[:200])
            return None, None
        if (why := charge.refusal(decoder.budget.capacity, decoder.cfg.decode_budget_mib)) is not None:
            logger.info("request %s: %s; the LM reads the upload itself", rid, why)
            return None, None
        try:
            (windows,), lease = await decoder.decode_under_budget(charge.nbytes, "audio", rid,
                                                                  [functools.partial(self.cut, audio)])
        except BadInput as e:  # the decode timed out: vLLM's app on the LM decodes it under its own bound
            logger.info("request %s: %s; the LM reads the upload itself", rid, e)
            return None, None
        if windows is None:  # vLLM's decoder refused it: nothing is held
            lease.release()
            return None, None
        return windows, lease

    async def file_part(self, body: bytes, content_type: str) -> bytes | None:
        """The upload's audio file as vLLM's app reads it, or None where it would refuse the request."""
        return await _file_part(body, content_type)

    def cut(self, audio: bytes) -> Windows | None:
        """``audio`` decoded and cut by vLLM's serving (blocking: run it on a decode thread), or None where
        vLLM's decoder refuses it (the LM then answers it)."""
        try:
            chunks, _ = SpeechToTextBaseServing._decode_and_chunk_speech(self._holder, audio)
        except Exception as e:  # noqa: BLE001 - vLLM's app refuses what its decoder refuses; the LM answers it
            logger.info("an upload's audio is not readable (%s): the LM reads it itself", str(e)[:200])
            return None
        return Windows(list(chunks), self.rate)


async def _file_part(body: bytes, content_type: str) -> bytes | None:
    """The ``file`` part of a form as vLLM's app reads it, or None where it would refuse the request."""
    scope = {"type": "http", "method": "POST", "path": "/", "query_string": b"", "root_path": "",
             "headers": [(b"content-type", content_type.encode("latin-1")),
                         (b"content-length", str(len(body)).encode())]}
    sent = False

    async def receive() -> dict:
        nonlocal sent
        if sent:
            return {"type": "http.disconnect"}
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    request = Request(scope, receive)
    try:
        form = await request.form()
    except Exception as e:  # noqa: BLE001 - FastAPI answers a body it cannot parse as a form with an error
        logger.info("an upload is not a readable form (%s): the LM reads it itself", str(e)[:200])
        return None
    try:
        file = form.get("file")
        if not isinstance(file, UploadFile):
            return None
        return await read_upload_with_limit(file)
    except Exception:  # noqa: BLE001 - vLLM's size bound: its app answers it
        return None
    finally:
        await form.close()
