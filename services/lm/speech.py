"""The LM's half of an encoder-decoder model's speech windows (issue 35; docs/design.md, "Encoder-decoder
models"): vLLM's speech-to-text serving on the LM cuts an upload into windows and renders one prompt per
window; ``name_windows`` names a window an encoder of the request encoded by its samples, the encoder's
rule (``services.common.media.window_id``), so vLLM's identifier for it is the encoder's, and
``mm_hashes`` reads which windows a rendered engine input names (``ConsumerEngine.generate`` gives each
engine call only those sources). Nothing here holds a buffer: the samples are vLLM's, read to hash."""

from __future__ import annotations

from services.common.media import window_id
from services.lm.context import RequestContext


def name_windows(prompt, ctx: RequestContext):
    """An encoder-decoder prompt (vLLM's speech-to-text serving: ``{"encoder_prompt": {"prompt": "",
    "multi_modal_data": {"audio": (samples, rate)}}, "decoder_prompt": ...}``, one window each) whose audio
    is a window an encoder of this request encoded: the window named by its samples
    (``services.common.media.window_id``, the encoder's rule, in the request's namespace) in
    ``multi_modal_uuids``, so vLLM's identifier for it is the encoder's and ``ConsumerEngine.generate``
    names its source. Any other prompt as it came (a window no encoder cut is encoded here)."""
    if not isinstance(prompt, dict) or not isinstance(prompt.get("encoder_prompt"), dict):
        return prompt
    enc = prompt["encoder_prompt"]
    clips = (enc.get("multi_modal_data") or {}).get("audio")
    if enc.get("multi_modal_uuids") or not isinstance(clips, tuple | list) or not clips:
        return prompt
    clips = [clips] if isinstance(clips, tuple) else list(clips)
    idents = []
    for clip in clips:
        if not isinstance(clip, tuple | list) or len(clip) != 2:
            return prompt
        samples, rate = clip
        idents.append(window_id(samples, int(rate), ctx.media.namespace if ctx.media is not None else ""))
    if not all(i in ctx.sources for i in idents):
        return prompt
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
