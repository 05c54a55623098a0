"""The LM's media: what it decodes itself, and the check that every item vLLM parsed is one the
gateway sent.

The LM never downloads and never takes an identifier it cannot verify. Two pieces, both after
vLLM's own parser (so they see the request exactly as vLLM reads it, whatever shape a content
part has):

- Loading (``RequestMedia``, used by ``services.lm.media_connector``, the vLLM media connector
  this process selects): vLLM hands every media URL of a request to the connector. Only data:
  URLs are loaded (the gateway sends the bytes of an item the LM encodes itself); each one's
  header is checked under the LM's ``MediaConfig`` (pixels per image and per request, audio and
  video length, video frame rate and frame count), its decoded size (for audio, the decode's peak
  and the processor's resample: ``services.common.decode_charge``) is taken from the service's
  decode budget, and vLLM's own decoder runs on an interruptible thread (``MediaDecoder``). The
  decoded object is recorded with the content hash of its bytes. http(s) and file URLs are
  refused: no caller's input decides what the LM dials. A speech upload that vLLM's own
  speech-to-text serving decodes (``services.lm.speech``) is charged the same way
  (``decode_speech``).
- The check (``check_items``), run by the renderer between vLLM's parsing and its processing:
  every parsed item must be one the gateway sent. A uuid-only item must be one whose source
  (encoder) the request names; an item with data must be one this request's connector loaded,
  and if it has a uuid, the uuid must be the content hash of its bytes in the request's
  embedding namespace (``GenerateRequest.namespace``). Anything else (a uuid the caller chose,
  data from another path, a modality the LM does not take from the gateway) is refused as bad
  input before anything reaches the engine.

Namespaces: every content hash here is ``content_id(bytes, namespace)``, the identifier the
gateway and the encoders compute for the request's tenant. In a non-empty namespace an item
with data and no uuid (the media the LM decodes itself: no encoder, an API whose converter
drops uuids, a stored Responses input rendered again) gets that hash as its uuid, so vLLM uses
it as the item's mm_hash instead of hashing the pixels: the LM's processor cache, encoder cache
and the prefix cache's multimodal keys are then per tenant too. A uuid-only item's identifier
comes with its source: the encoder computed it from the bytes in the same namespace, and serves
it only under the claim of the Encode call that did. The empty namespace changes nothing
(vLLM hashes an item without a uuid as ``vllm serve`` does).

Owner: ``RequestMedia`` is made per Generate call by the servicer and released when the call's
prompt has been processed (the renderer) or the call ends (the servicer), whichever is first;
``release`` gives the decode budget back and is idempotent.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Protocol

from services.common.budget import DecodeLease
from services.common.decode_charge import AudioRefused, chat_charge, speech_charge
from services.common.errors import BadInput, MediaError
from services.common.media import MediaDecoder, content_id
from services.common.media_checks import (
    BYTES_PER_PIXEL,
    MAX_SAMPLED_FRAMES,
    VideoHeader,
    check_audio,
    check_image,
    check_video,
)

MODALITIES = ("image", "audio", "video")
"""What the LM takes from the gateway (as uuid-only items or data: URLs)."""


class EncodedElsewhere:
    """What the LM's media connector returns, instead of decoding, for a data: URL whose bytes an
    encoder of this request has laid out (the gateway names it by the content hash of those bytes):
    the Anthropic Messages API, whose converter drops uuids, sends each image's bytes. The renderer
    turns it into the uuid-only item it stands for; nothing is decoded here."""

    __slots__ = ("identifier", "modality")

    def __init__(self, modality: str, identifier: str) -> None:
        self.modality, self.identifier = modality, identifier


class RequestItems(Protocol):
    """What the checks here read of a call's ``RequestContext`` (``services.lm.context``, which holds a
    ``RequestMedia``: this module does not import it, so the two make no import circle)."""

    sources: dict[str, Any]
    """Per item identifier, the encoder an item comes from."""
    layouts: dict[str, Any]
    """Per item identifier, its prompt layout from the encoder's metadata."""
    media: RequestMedia | None
    """The media this LM decodes itself for the call."""


class RequestMedia:
    """One call's media decoded on this LM: per decoded object (by identity), the content hash of
    the bytes it came from, and the decode budget they hold."""

    def __init__(self, decoder: MediaDecoder, rid: str = "", namespace: str = "", audio_rate: int | None = None) -> None:
        """``namespace``: the request's embedding namespace (``GenerateRequest.namespace``), in which
        every content hash here is computed. ``audio_rate``: the rate the model's processor resamples
        audio to, for the audio decode charge (None: a resample to at most a clip's own rate is charged)."""
        self.decoder, self.rid, self.namespace, self.audio_rate = decoder, rid, namespace, audio_rate
        self.loaded: dict[int, tuple[Any, str]] = {}  # id(object) -> (object, content hash); holds the object
        self.pixels = 0
        self._leases: list[DecodeLease] = []

    def hash_of(self, obj: Any) -> str | None:
        """The content hash of the bytes ``obj`` was decoded from here, or None if it was not."""
        entry = self.loaded.get(id(obj))
        return entry[1] if entry is not None and entry[0] is obj else None

    def encoded_elsewhere(self, modality: str, data: bytes, ctx: RequestItems) -> EncodedElsewhere | None:
        """An ``EncodedElsewhere`` for ``data`` when an encoder of this request laid it out (its
        content hash has a source and a layout), recorded like a decoded item; else None."""
        ident = content_id(data, self.namespace)
        if ident not in ctx.sources or ident not in ctx.layouts:
            return None
        obj = EncodedElsewhere(modality, ident)
        self.loaded[id(obj)] = (obj, ident)
        return obj

    async def load(self, modality: str, data: bytes, loader: Callable[[bytes], Any],
                   sampled_frames: Callable[[VideoHeader], int] | None = None) -> Any:
        """``loader(data)`` (vLLM's decoder) after the header checks, under the decode budget, on an
        interruptible thread; the result is recorded with ``content_id(data, namespace)``. Raises BadInput
        (over a limit, bad bytes, too slow) or NoCapacity (no room in the budget in time)."""
        cfg = self.decoder.cfg
        (nbytes,) = await self.decoder.run_all([functools.partial(self._header, modality, data, sampled_frames)],
                                               f"{modality} header")
        if modality == "image":
            self.pixels += nbytes // BYTES_PER_PIXEL
            if self.pixels > cfg.max_request_pixels:
                raise BadInput(f"the request's images have more than {cfg.max_request_pixels} pixels together "
                               "(--max-request-pixels)")
        if nbytes > self.decoder.budget.capacity:
            raise BadInput(f"a {modality} item decodes to {nbytes >> 20} MiB, more than this service decodes at once "
                           f"({cfg.decode_budget_mib:g} MiB, --decode-budget-mib)")
        (obj,), lease = await self.decoder.decode_under_budget(nbytes, modality, self.rid,
                                                               [functools.partial(_load, modality, loader, data)])
        self._leases.append(lease)
        self.loaded[id(obj)] = (obj, content_id(data, self.namespace))
        return obj

    def _header(self, modality: str, data: bytes, sampled_frames: Callable[[VideoHeader], int] | None) -> int:
        """Decoded bytes of one item from its header alone (blocking: run on a decode thread)."""
        cfg = self.decoder.cfg
        try:
            if modality == "image":
                _, w, h = check_image(data, cfg.max_image_pixels)
                return w * h * BYTES_PER_PIXEL
            if modality == "audio":
                check_audio(data, cfg.max_audio_seconds)
                return _chat_charge(data, self.audio_rate, cfg.max_audio_seconds)
            header = check_video(data, cfg.max_video_seconds, cfg.max_image_pixels, max_fps=cfg.max_video_fps,
                                 max_frames=cfg.max_video_frames)
            sampled = sampled_frames(header) if sampled_frames else min(header.frames, MAX_SAMPLED_FRAMES)
            return header.decoded_bytes(max(1, sampled))
        except MediaError as e:
            raise BadInput(f"{modality}: {e}") from None

    async def decode_speech(self, data: bytes, cut: Callable[[bytes], Any], rate: int, max_seconds: float,
                            max_decode_bytes: int) -> Any:
        """``cut(data)`` (vLLM's speech-to-text serving's decode of an upload, to mono at the model's
        ``rate``, cut into windows: ``(windows, seconds)``, the float32 arrays and the clip's length) after its peak, read from the file's header, was taken from the
        decode budget, on an interruptible thread; the windows' own bytes stay charged until ``release``.
        Raises AudioRefused (a ValueError, which vLLM's serving answers 400 as its own) where vLLM refuses
        the file from its header or the peak would not fit the whole budget, BadInput where the decode
        outlives ``--decode-timeout-s``, NoCapacity where the budget had no room in time."""
        (charge,) = await self.decoder.run_all(
            [functools.partial(speech_charge, data, rate, max_seconds, max_decode_bytes)], "audio header")
        if (why := charge.refusal(self.decoder.budget.capacity, self.decoder.cfg.decode_budget_mib)) is not None:
            raise AudioRefused(why)
        (out,), lease = await self.decoder.decode_under_budget(charge.nbytes, "audio", self.rid,
                                                               [functools.partial(cut, data)])
        windows, _ = out
        lease.keep(sum(w.nbytes for w in windows))
        self._leases.append(lease)
        return out

    def release(self) -> None:
        """Gives the call's decode budget back and drops the decoded media (they have been
        processed, or the call ended). Idempotent; ``check_items`` runs before it."""
        for lease in self._leases:
            lease.release()
        self._leases.clear()
        self.loaded.clear()


def _chat_charge(data: bytes, audio_rate: int | None, max_seconds: float) -> int:
    """A chat clip's decode peak (``decode_charge.chat_charge``, under vLLM's own decode bounds), or
    MediaError where vLLM refuses it from its header."""
    import vllm.envs as envs

    try:
        return chat_charge(data, audio_rate, max_seconds, envs.VLLM_MAX_AUDIO_DECODE_BYTES).nbytes
    except AudioRefused as e:
        raise MediaError(str(e)) from None


def _load(modality: str, loader: Callable[[bytes], Any], data: bytes) -> Any:
    try:
        return loader(data)
    except Exception as e:  # noqa: BLE001 - decoders raise many types for bad data
        raise BadInput(f"{modality} could not be decoded: {e}") from None


def check_items(prompt: dict, ctx: RequestItems) -> None:
    """Refuses (BadInput) a parsed prompt (vLLM's ``render_messages`` output: ``multi_modal_data``
    and ``multi_modal_uuids`` per modality) with any item the gateway did not send this way: see
    the module docstring. ``prompt_embeds`` never come here (vLLM refuses them: not enabled).
    In a non-empty namespace, each item with data and no uuid gets its content hash as uuid (in
    ``prompt``, which vLLM then processes)."""
    data = prompt.get("multi_modal_data") or {}
    uuids = prompt.get("multi_modal_uuids") or {}
    namespace = ctx.media.namespace if ctx.media is not None else ""
    named: dict[str, list] = {}
    for modality in set(data) | set(uuids):
        if modality not in MODALITIES:
            raise BadInput(f"{modality} items are not taken by this LM (only {', '.join(MODALITIES)}, "
                           "from the gateway)")
        values = _as_list(data.get(modality))
        idents = _as_list(uuids.get(modality))
        if not values:
            values = [None] * len(idents)
        if not idents:
            idents = [None] * len(values)
        if len(values) != len(idents):
            raise BadInput(f"{modality}: {len(values)} items but {len(idents)} identifiers")
        for i, (value, ident) in enumerate(zip(values, idents)):
            _check_item(modality, i, value, ident, ctx)
        if namespace and any(v is not None and u is None for v, u in zip(values, idents)):
            named[modality] = [ctx.media.hash_of(v) if v is not None and u is None else u
                               for v, u in zip(values, idents)]
    if named:
        prompt["multi_modal_uuids"] = {**uuids, **named}


def _check_item(modality: str, i: int, value: Any, ident: Any, ctx: RequestItems) -> None:
    what = f"{modality} {i}"
    if value is None:
        if ident is None or ident not in ctx.sources:
            raise BadInput(f"{what} has no data and no encoder this request names "
                           f"({str(ident)[:16]!r}...): identifiers come from the gateway's encoders")
        return
    digest = ctx.media.hash_of(value) if ctx.media is not None else None
    if digest is None:
        raise BadInput(f"{what} was not loaded from a data: URL of this request (the LM takes media bytes "
                       "only as data: URLs from the gateway)")
    if ident is not None and ident != digest:
        raise BadInput(f"{what}: its uuid {str(ident)[:16]!r}... is not the content hash of its bytes in the "
                       "request's namespace")


def _as_list(value: Any) -> list:
    if value is None:
        return []
    return list(value) if isinstance(value, list | tuple) else [value]
