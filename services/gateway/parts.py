"""Where a request's media are: its content parts, read by vLLM 0.32's own rule, without vLLM.

The gateway and the LM's vLLM read one request body. If the gateway found fewer media items than
vLLM does, the ones it missed would reach the LM unchecked (a URL the LM's vLLM would fetch, an
identifier a caller chose), so the gateway reads parts exactly as vLLM's chat parser does
(``vllm/renderers/chat_utils.py``: ``_parse_chat_message_content_mm_part`` and
``_parse_chat_message_content_part``), for every message whatever its role:

- a string part is text;
- a dict whose ``type`` is one of vLLM's part types (``PART_TYPES``) and that has no ``uuid`` is
  that type;
- a dict with no ``type``, or with a ``uuid`` (vLLM then ignores ``type``), is typed by the first
  of its keys in ``KEY_ORDER``; a dict with none of them is an error (vLLM: "Missing 'type'");
- any other ``type`` is vLLM's to refuse (an unknown or non-string type).

A typed ``image_url`` or ``input_image`` part is validated as vLLM's parser validates it (pydantic,
on the ``openai`` package's types: ``MM_PARSER_MAP`` there), so a part vLLM refuses (an object
``image_url`` in an ``input_image`` part, a ``detail`` it does not know) is refused here too, never
rewritten into one it takes. A Responses request is read as vLLM's conversion to chat messages reads it
(``vllm/entrypoints/openai/responses/utils.py``, ``_construct_message_from_response_item``): an
assistant item whose first part has text is text only; any other item's parts are chat parts (vLLM's
request model types them only where an item matches a typed Responses item: an item with an ``id``
passes as an ``item_reference`` and reaches the chat parser as it came), so the gateway rewrites each
media part as the kind it came as (``OpenAICall.lm_body``) and leaves a kind the request model refuses
for vLLM to refuse.

On top of vLLM's rule, what the gateway refuses (a 400 naming the part; docs/protocol.md lists
them): a client ``uuid`` on any part (identifiers are content hashes the gateway makes; vLLM would
use a client's verbatim as the item's cache key), and parts that carry pre-computed inputs
(``PRECOMPUTED``: embeddings, prompt embeddings, PIL objects), which epd-serve does not serve.

This module imports nothing from vLLM (the gateway stays free of torch). Its tables are checked
against vLLM's own in tests/unit/test_parts_vllm.py, which with tests/unit/test_responses_parts_vllm.py
and tests/unit/test_anthropic_parts_vllm.py generates bodies of each API and checks that the items
vLLM's conversion and parser extract are exactly the ones found here, and that a body vLLM refuses is
refused here or still refused by vLLM as the gateway sends it on.
The LM checks every item vLLM parsed again (``services.lm.media``): this reader decides what the
gateway loads, hashes and limits; the LM's check is the authority on what reaches its engine.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

TEXT, MEDIA, PRECOMPUTED, OTHER = "text", "media", "precomputed", "other"

PART_TYPES: dict[str, str] = {
    "text": TEXT, "thinking": TEXT, "input_text": TEXT, "output_text": TEXT, "refusal": TEXT,
    "image_url": MEDIA, "input_image": MEDIA, "audio_url": MEDIA, "input_audio": MEDIA, "video_url": MEDIA,
    "image_embeds": PRECOMPUTED, "audio_embeds": PRECOMPUTED, "video_embeds": PRECOMPUTED,
    "prompt_embeds": PRECOMPUTED, "image_pil": PRECOMPUTED,
    "tool_reference": OTHER,
}
"""vLLM 0.32's content part types (the keys of its ``MM_PARSER_MAP``) and what each carries."""

KEY_ORDER = ("image_url", "image_pil", "image_embeds", "audio_embeds", "video_embeds", "prompt_embeds",
             "audio_url", "input_audio", "video_url", "tool_reference")
"""The keys vLLM types an untyped (or uuid-carrying) part by, in the order it tries them."""

MODALITY = {"image_url": "image", "input_image": "image", "audio_url": "audio", "input_audio": "audio",
            "video_url": "video"}
"""Each media part type's modality."""

LM_PART = {"image": "image_url", "audio": "audio_url", "video": "video_url"}
"""The part type the gateway writes for each modality in the LM's body."""

INPUT_AUDIO_FORMATS = ("wav", "mp3", "flac", "ogg")


class PartError(ValueError):
    """A part the gateway refuses (400); ``where`` names it (``messages[0].content[1]``)."""

    def __init__(self, where: str, message: str) -> None:
        super().__init__(f"{where}: {message}")
        self.where = where


@dataclass(frozen=True)
class MediaPart:
    """One media item of a request, in request order: where it is, its vLLM part type and
    modality, and its source (a URL; an ``input_audio`` part's data as a data: URL). ``inner``: an
    Anthropic tool result's image, ``content[part].content[inner]``; else -1. ``key``: the list of
    parts it is in (``content``; a Responses tool output item's ``output``)."""

    message: int
    part: int
    kind: str
    modality: str
    source: str
    inner: int = -1
    container: str = "messages"
    key: str = "content"

    @property
    def where(self) -> str:
        inner = f".content[{self.inner}]" if self.inner >= 0 else ""
        return f"{self.container}[{self.message}].{self.key}[{self.part}]{inner}"


def part_type(part: Any) -> str | None:
    """The type vLLM gives ``part`` (a key of ``PART_TYPES``), "" for a string part, or None
    when vLLM would not read it as any known type (it refuses those itself)."""
    if isinstance(part, str):
        return "text"
    if not isinstance(part, dict):
        return None
    kind = part.get("type")
    if isinstance(kind, str) and kind in PART_TYPES and part.get("uuid") is None:
        return kind
    if kind is None or part.get("uuid") is not None:
        return next((key for key in KEY_ORDER if key in part), None)
    return None


TOOL_OUTPUTS = ("function_call_output", "custom_tool_call_output")
"""Responses input items whose ``output`` vLLM makes a tool message's content
(``vllm/entrypoints/openai/responses/utils.py``): a list of parts there is read as chat parts."""


def media_parts(messages: Any, container: str = "messages", most: int | None = None) -> list[MediaPart]:
    """Every media part of a chat request's ``messages`` (any role), or of a Responses request's
    ``input`` items (their ``content``, and a tool output item's ``output``), by vLLM's rule, in order.
    Raises PartError for a client uuid, a pre-computed input, a media part without a source, or a
    part vLLM's own validation refuses. Anything that is not a list of message objects has no media
    here (vLLM validates it). ``most``: the walk stops at the part after ``most`` media parts (the
    caller refuses a request with more: ``request.parse_openai``), so the work on a body of a million
    images is the work on ``most + 1`` of them, not the validation of each."""
    found: list[MediaPart] = []
    responses = container == "input"
    for i, message in enumerate(messages if isinstance(messages, list) else []):
        key = "content"
        if responses and isinstance(message, dict) and message.get("type") in TOOL_OUTPUTS:
            key = "output"
        content = message.get(key) if isinstance(message, dict) else None
        if responses and _text_only_assistant(message):
            continue
        refuses_images = responses and _output_item_model(message)
        for j, part in enumerate(content if isinstance(content, list) else []):
            where = f"{container}[{i}].{key}[{j}]"
            if isinstance(part, dict) and part.get("uuid") is not None:
                raise PartError(where, "a client may not set uuid (epd-serve names media by their content)")
            kind = part_type(part)
            role = PART_TYPES.get(kind or "")
            if role == PRECOMPUTED:
                raise PartError(where, f"{kind} parts are not served by epd-serve (pre-computed inputs; "
                                       f"served media: {', '.join(MODALITY)})")
            if role != MEDIA:
                continue
            if refuses_images:
                raise PartError(where, "vLLM's parser refuses an image in a custom_tool_call_output item with an id "
                                       "and a status (it reads the item as a response's output item)")
            if part.get("type") == kind and kind in ("image_url", "input_image"):
                _check_typed(part, kind, where, default_detail=responses and key == "content")
            found.append(MediaPart(i, j, kind, MODALITY[kind], _source(part, kind, where), container=container,
                                   key=key))
            if most is not None and len(found) > most:
                return found
    return found


def _text_only_assistant(item: Any) -> bool:
    """Whether vLLM reads a Responses input item as an assistant message of text only (its images
    dropped): a dict with role ``assistant`` whose content is a string, or a list whose first part has
    a ``text`` (``_construct_message_from_response_item``; any other assistant item it passes on as a
    chat message, every part read)."""
    if not isinstance(item, dict) or item.get("role") != "assistant" or item.get("type") in TOOL_OUTPUTS:
        return False
    content = item.get("content")
    if isinstance(content, str):
        return True
    return isinstance(content, list) and bool(content) and isinstance(content[0], dict) \
        and content[0].get("text") is not None


def _output_item_model(item: Any) -> bool:
    """Whether vLLM's request model reads a Responses input item as its ``ResponseCustomToolCallOutputItem``
    (a ``custom_tool_call_output`` with an ``id`` and a status): vLLM converts that model back with
    ``model_dump``, which gives each image part ``prompt_cache_breakpoint: null``, and its parser's
    ``ResponseInputImageParam`` then refuses the part (400). The gateway refuses it too: its rewrite
    names the item by a uuid, which vLLM's parser would take without that check."""
    return isinstance(item, dict) and item.get("type") == "custom_tool_call_output" \
        and isinstance(item.get("id"), str) and item.get("status") in ("in_progress", "completed", "incomplete")


@functools.cache
def _validator(kind: str):
    """vLLM's validator for a typed ``kind`` part (``MM_PARSER_MAP``: a pydantic ``TypeAdapter`` of the
    ``openai`` package's type). Made on first use: the ``openai`` types take half a second to import."""
    from pydantic import TypeAdapter

    if kind == "image_url":
        from openai.types.chat import ChatCompletionContentPartImageParam as PartType
    else:
        from openai.types.responses import ResponseInputImageParam as PartType
    return TypeAdapter(PartType).validate_python


def _check_typed(part: dict, kind: str, where: str, default_detail: bool) -> None:
    """Refuses (PartError) a typed ``image_url`` / ``input_image`` part that vLLM's parser refuses.
    ``default_detail``: a Responses message's part, whose missing ``detail`` vLLM's request model sets
    to "auto" first (``_default_input_image_details``); a chat message's or a tool output's part has none."""
    from pydantic import ValidationError

    if default_detail and "detail" not in part:
        part = {**part, "detail": "auto"}
    try:
        _validator(kind)(part)
    except ValidationError as e:
        first = e.errors()[0]
        loc = ".".join(str(x) for x in first.get("loc", ()))
        raise PartError(where, f"not a valid {kind} part: {loc + ': ' if loc else ''}{first.get('msg', e)}") from None


def anthropic_media_parts(messages: Any, most: int | None = None) -> list[MediaPart]:
    """Every image of an Anthropic Messages body, by vLLM 0.32's converter
    (``vllm/entrypoints/anthropic/serving.py``: ``_convert_block`` and ``_convert_user_tool_result``):
    a content block of type ``image`` with a source, and, in a user message, the ``image`` items of a
    ``tool_result`` block's content list (vLLM puts those first, in a message of their own, then the
    message's own images; a system message's images are dropped). Each source is read as ``_convert_image_source_to_url``
    reads it (``url``: its URL; anything else: base64 data with its media type). Everything else in
    the body is text to vLLM's converter (it drops keys it does not know, ``uuid`` included). ``most``: as
    for ``media_parts`` (more than ``most`` images found, in any order, are returned at once)."""
    found: list[MediaPart] = []
    for i, message in enumerate(messages if isinstance(messages, list) else []):
        content = message.get("content") if isinstance(message, dict) else None
        if message.get("role") == "system" if isinstance(message, dict) else True:
            continue  # vLLM keeps only a system message's text
        own: list[MediaPart] = []  # vLLM emits a message's tool-result images first, then its own
        for j, block in enumerate(content if isinstance(content, list) else []):
            if not isinstance(block, dict):
                continue
            if block.get("type") == "image" and block.get("source"):
                where = f"messages[{i}].content[{j}].source"
                own.append(MediaPart(i, j, "image", "image", _usable(_anthropic_url(block["source"], where), where)))
            elif block.get("type") == "tool_result" and message.get("role") == "user" \
                    and isinstance(block.get("content"), list):
                for k, item in enumerate(block["content"]):
                    if isinstance(item, dict) and item.get("type") == "image":
                        where = f"messages[{i}].content[{j}].content[{k}].source"
                        url = _anthropic_url(item.get("source", {}), where)
                        if url:  # vLLM skips an image whose source makes no URL
                            found.append(MediaPart(i, j, "image", "image", _usable(url, where), inner=k))
                    if most is not None and len(found) + len(own) > most:
                        return found + own
            if most is not None and len(found) + len(own) > most:
                return found + own
        found += own
    return found


def _anthropic_url(source: Any, where: str) -> str:
    """``_convert_image_source_to_url``: a ``url`` source's URL, else a data: URL of the base64 data
    with its media type (image/jpeg when none is given)."""
    if not isinstance(source, dict):
        raise PartError(where, "an image source must be an object (base64 or url)")
    if source.get("type") == "url":
        url = source.get("url", "")
        return url if isinstance(url, str) else ""
    return f"data:{source.get('media_type', 'image/jpeg')};base64,{source.get('data', '')}"


def _usable(url: str, where: str) -> str:
    if not url or url.endswith(";base64,"):
        raise PartError(where, "an image needs base64 data or a url")
    return url


def _source(part: dict, kind: str, where: str) -> str:
    """A media part's URL as vLLM reads it: a typed part's ``{"url": ...}`` object (a plain string
    for ``input_image``, the Responses API's shape), an untyped part's object or value; an
    ``input_audio`` part's base64 data and format as a data: URL."""
    typed = part.get("type") == kind
    value = part.get("image_url" if kind == "input_image" else kind)
    if kind == "input_audio":
        data = value.get("data") if isinstance(value, dict) else None
        fmt = value.get("format") if isinstance(value, dict) else None
        if not isinstance(data, str) or not data:
            raise PartError(where, "input_audio.data is required (base64 audio)")
        if fmt not in INPUT_AUDIO_FORMATS:
            raise PartError(where, f"input_audio.format must be one of {', '.join(INPUT_AUDIO_FORMATS)}; "
                                   f"got {fmt!r}")
        return f"data:audio/{fmt};base64,{data}"
    if kind == "input_image" or not typed:
        url = value.get("url") if isinstance(value, dict) else value
    else:
        url = value.get("url") if isinstance(value, dict) else None
    if not isinstance(url, str) or not url:
        shape = "a string" if kind == "input_image" else '{"url": "..."}'
        raise PartError(where, f"{kind} needs a URL ({shape}; a data: URL or http(s))")
    return url
