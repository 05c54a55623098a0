"""The LM's half of an encoder-decoder model's speech uploads (docs/design.md, "Encoder-decoder models"): vLLM's speech-to-text serving on the LM decodes an upload, cuts it into windows and renders one
prompt per window (and, for a request without ``language``, one prompt of its own for the first window).

- ``name_windows`` names every window the LM's vLLM is about to process by its samples, the encoder's rule
  (``services.common.media.window_id``), in the request's embedding namespace: a window an encoder of the
  request encoded gets the encoder's identifier (``ConsumerEngine.generate`` then names its source), and a
  window the LM encodes itself (no encoder, a window cut differently, the language detection's) is never
  hashed by vLLM from its samples alone, so vLLM's processor and encoder caches stay per tenant;
  ``mm_hashes`` reads which windows a rendered engine input names.
- ``guard_servings`` sets vLLM's speech-to-text servings up for the LM at start: each upload's decode is
  charged its peak from the file's header before it runs (``RequestMedia.decode_speech``, the call's decode
  budget), and every prompt they render or submit is named (``name_windows``).

Nothing here holds a buffer: the samples are vLLM's, read to hash; the decode's budget is the call's
``RequestMedia``'s, given back when the call ends.
"""

from __future__ import annotations

from typing import Any

from services.common.errors import EPDError
from services.common.media import window_id
from services.lm.context import CURRENT, RequestContext

SERVINGS = ("openai_serving_transcription", "openai_serving_translation")
"""Where vLLM's app keeps its speech-to-text servings (``app.state``); absent for other models."""


def name_windows(prompt, ctx: RequestContext):
    """An encoder-decoder prompt (vLLM's speech-to-text serving: ``{"encoder_prompt": {"prompt": "",
    "multi_modal_data": {"audio": (samples, rate)}}, "decoder_prompt": ...}``, one window each) with each
    window named by its samples (``services.common.media.window_id``, the encoder's rule, in the request's
    namespace) in ``multi_modal_uuids``. A prompt that names its audio already, and any other prompt, as it
    came."""
    if not isinstance(prompt, dict) or not isinstance(prompt.get("encoder_prompt"), dict):
        return prompt
    enc = prompt["encoder_prompt"]
    clips = (enc.get("multi_modal_data") or {}).get("audio")
    if enc.get("multi_modal_uuids") or not isinstance(clips, tuple | list) or not clips:
        return prompt
    clips = [clips] if isinstance(clips, tuple) else list(clips)
    namespace = ctx.media.namespace if ctx.media is not None else ""
    idents = []
    for clip in clips:
        if not isinstance(clip, tuple | list) or len(clip) != 2:
            return prompt
        samples, rate = clip
        idents.append(window_id(samples, int(rate), namespace))
    return {**prompt, "encoder_prompt": {**enc, "multi_modal_uuids": {"audio": idents}}}


def mm_hashes(engine_input) -> set[str]:
    """The media identifiers of a rendered engine input (vLLM's ``mm_hashes``, wherever its encoder-decoder
    input keeps them)."""
    out: set[str] = set()
    if not isinstance(engine_input, dict):
        return out
    for part in (engine_input, engine_input.get("encoder_prompt"), engine_input.get("decoder_prompt")):
        if isinstance(part, dict):
            for hashes in (part.get("mm_hashes") or {}).values():
                out.update(h for h in hashes if isinstance(h, str))
    return out


def guard_servings(state) -> None:
    """Sets up each of vLLM's speech-to-text servings in ``state`` (its app's, built once at start) for the
    LM: its decode charged (``charged_decode``), its renderer and engine naming every window
    (``NamingRenderer``, ``NamingEngine``). Idempotent; a state without such servings is left alone."""
    for name in SERVINGS:
        serving = getattr(state, name, None)
        if serving is None or isinstance(serving.renderer, NamingRenderer):
            continue
        serving._decode_and_chunk_speech_async = charged_decode(serving)
        serving.renderer = NamingRenderer(serving.renderer)
        serving.engine_client = NamingEngine(serving.engine_client)


def charged_decode(serving):
    """vLLM's decode of an upload for ``serving`` (its ``_decode_and_chunk_speech``, what its
    ``_decode_and_chunk_speech_async`` runs) through the current call's ``RequestMedia.decode_speech``:
    charged before it runs, on the LM's decode threads. vLLM answers a ValueError (its own header rules,
    the budget's refusal) 400 as for `vllm serve`; a budget with no room in time or a decode past its
    timeout is the call's failure (``RequestContext.failure``: the servicer's status)."""
    rate = int(serving.asr_config.sample_rate)

    async def decode(audio_data: bytes):
        ctx = CURRENT.get()
        if ctx is None or ctx.media is None:
            raise ValueError("a speech upload is decoded here only within a Generate call")
        try:
            return await ctx.media.decode_speech(audio_data, serving._decode_and_chunk_speech, rate,
                                                 serving.max_audio_decode_duration_s,
                                                 serving.max_audio_decode_bytes)
        except EPDError as e:
            ctx.failure = e
            raise

    return decode


class NamingRenderer:
    """A speech-to-text serving's renderer: each window prompt named (``name_windows``) before the wrapped
    renderer (the LM's ``LaidOutRenderer``) renders it. Every other attribute is the wrapped one's."""

    def __init__(self, inner) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    async def render_cmpl_async(self, prompts, *args, **kwargs):
        ctx = CURRENT.get() or RequestContext()
        return await self._inner.render_cmpl_async([name_windows(p, ctx) for p in prompts], *args, **kwargs)


class NamingEngine:
    """A speech-to-text serving's engine client: a prompt it submits unrendered (the language detection's
    first window) named (``name_windows``) before the wrapped engine (the LM's ``ConsumerEngine``) takes it.
    Every other attribute is the wrapped one's."""

    def __init__(self, inner) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def generate(self, prompt, *args, **kwargs):
        return self._inner.generate(name_windows(prompt, CURRENT.get() or RequestContext()), *args, **kwargs)
