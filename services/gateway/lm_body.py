"""The body each LM attempt of a request gets (``LMBody.render``), from what the request model read
(``request.OpenAICall.for_lm``) and what the attempt's encoders said of each item (``req.items``'
sources): the client's body with each media part rewritten for the LM, the request's id and the
tenant's ``cache_salt``. A value the orchestration renders once per attempt (the items of an attempt can
differ: a re-encode, a failover to the LM's own encoder; so can the LM, which a Responses request's id
names: ``services.gateway.responses``); it does no I/O and calls nothing back.

The ``LMBody`` shares the request's body dict and parts (never changed here: a part rewrite works on a
copy); the request owns them and frees them when it is answered."""

from __future__ import annotations

import copy
import hashlib
import json
import uuid
from dataclasses import dataclass, field
from typing import Any

import pybase64

from epd.lm.v1 import lm_pb2
from services.common.media_checks import sniff_audio_format, sniff_video_format
from services.common.routes import API
from services.gateway.parts import LM_PART, MediaPart
from services.gateway.responses import ResponseIds
from services.gateway.values import Media

MIME = {"WAV": "audio/wav", "FLAC": "audio/flac", "OGG": "audio/ogg", "MP3": "audio/mpeg",
        "MP4": "video/mp4", "WEBM": "video/webm", "AVI": "video/x-msvideo"}
CACHE_SALT_FORBIDDEN = frozenset("@/\\\x00")
CACHE_SALT_MAX = 128
"""vLLM's rule for a ``cache_salt`` (``vllm/entrypoints/generate/base/protocol.py``; checked against it by
tests/unit/test_tenant_salt_vllm.py)."""


def tenant_salt(tenant: str, client_salt: Any) -> Any:
    """The ``cache_salt`` a tenant's request reaches vLLM with: its prefix-cache entries are then its own, so
    no tenant can tell from a first token's time whether another sent the same prompt (vLLM hashes the salt
    into a prompt's first block). ``tenant:`` and, for a client's own salt, its digest: a tenant name holds
    no ``:``, so no client salt can make another tenant's. A client salt vLLM would refuse is passed on as
    it came, so the client gets vLLM's own 400."""
    if client_salt is None:
        return f"{tenant}:"
    if not isinstance(client_salt, str) or not client_salt or len(client_salt) > CACHE_SALT_MAX \
            or any(c in CACHE_SALT_FORBIDDEN for c in client_salt):
        return client_salt
    return f"{tenant}:{hashlib.sha256(client_salt.encode()).hexdigest()[:40]}"


@dataclass
class LMBody:
    """What an LM attempt's body is made from (``request.OpenAICall``'s fields of the same names)."""

    api: str
    body: dict[str, Any]
    parts: list[MediaPart] = field(default_factory=list)
    upload: bytes = b""
    request_id: str = ""
    id_given: bool = False
    response_id: str = ""
    salt_tenant: str = ""
    media: list[Media] = field(default_factory=list)
    """The request's media items, in order (the request's list: every API's, an API that encodes none
    included, whose parts still go to the LM as data: URLs)."""
    response_ids: ResponseIds | None = None
    """Mints the id of the response a Responses request stores (None: ``response_id`` as it is)."""
    owner: str = ""
    """The tenant whose response it is (its id verifies for it alone)."""
    nbytes: int = 0
    """The client's JSON body's size as it arrived (``OpenAICall.nbytes``)."""

    def render(self, req: lm_pb2.GenerateRequest, media: list[Media] | None = None, home: str = "") -> bytes:
        """The body for one LM attempt: each item an encoder laid out becomes a uuid-only part (the
        LM never sees its bytes); any other item a data: URL of the bytes the gateway read (the LM
        never downloads), with its content hash as uuid when an encoder has its embedding. Audio goes
        as vLLM's ``audio_url`` part (an ``input_audio`` part too). An upload goes as it came.
        ``media``: the request's items (default: ``self.media``). ``home``: the address of the LM that
        answers (and stores) this attempt's response: a fresh id names it and ``owner``."""
        media = self.media if media is None else media
        if API[self.api].upload:
            return self.upload
        body = copy.deepcopy(self.body) if self.parts else dict(self.body)
        spec = API[self.api]
        if self.request_id and spec.lm_api != "http" and (self.id_given or not body.get("request_id")):
            body["request_id"] = self.request_id
        if self.response_id:
            minted = self.response_ids is not None and home
            body["request_id"] = self.response_ids.mint(home, self.owner) if minted else self.response_id
        if self.salt_tenant and spec.generates:
            body["cache_salt"] = tenant_salt(self.salt_tenant, body.get("cache_salt"))
        items, splice = list(req.items) if spec.encode else [None] * len(media), Splice()
        # The LM lays a prompt out from the encoders' layouts only when every item has one; else its
        # processor lays the whole prompt out and needs every item's bytes.
        laid_out = spec.encode and all(item.source.placeholder_token_ids for item in req.items)
        for p, item, m in zip(self.parts, items, media):
            ident = item.identifier if item is not None and (laid_out or item.HasField("source")) else None
            if spec.media == "anthropic":
                # vLLM's converter drops any uuid: the LM knows an encoder's image by its content hash.
                block = body["messages"][p.message]["content"][p.part]
                if p.inner >= 0:
                    block = block["content"][p.inner]
                block["source"] = {"type": "base64", "media_type": "image/png",
                                   "data": splice.add(pybase64.b64encode(m.data))}
                continue
            if spec.media == "input":
                # The bytes go too, even for an item an encoder laid out (the LM knows it by its hash
                # and does not decode it): vLLM stores a response's input as given, and a follow-up
                # (previous_response_id) renders it again, with no encoder named for it then. The part
                # keeps its kind: vLLM's request model takes a chat part only where it took the client's.
                if p.kind == "input_image":
                    part: dict[str, Any] = {"type": "input_image", "image_url": splice.add(*_data_url(m))}
                    given = body[p.container][p.message][p.key][p.part]
                    if isinstance(given, dict) and "detail" in given:
                        part["detail"] = given["detail"]  # vLLM requires it of a tool output's image
                else:
                    kind = p.kind if p.kind != "input_audio" else "audio_url"
                    part = {"type": kind, kind: {"url": splice.add(*_data_url(m))}}
            else:
                kind = LM_PART[m.modality]  # the bytes only where the LM's processor lays the prompt out
                part = {"type": kind, kind: None if laid_out else {"url": splice.add(*_data_url(m))}}
            if ident is not None:
                part["uuid"] = ident  # else the LM encodes it itself and hashes it as vLLM does
            body[p.container][p.message][p.key][p.part] = part
        return splice.join(json.dumps(body, ensure_ascii=False).encode())


def _data_url(m: Media) -> tuple[bytes, bytes]:
    """``m`` as a data: URL, in two pieces: its header and its base64 (``pybase64``: the same text as
    ``base64``'s, in a fraction of the time)."""
    if m.modality == "image":
        mime = "image/png"  # the LM's image decoder sniffs the format
    else:
        sniffed = sniff_audio_format(m.data) if m.modality == "audio" else sniff_video_format(m.data)
        mime = MIME.get(sniffed or "", f"{m.modality}/octet-stream")
    return f"data:{mime};base64,".encode(), pybase64.b64encode(m.data)


class Splice:
    """Media put into a rendered body after ``json.dumps``, not through it. ``add`` returns a token that
    stands for the item's text in the body (``prefix``, 128 random bits no client can write, its number
    and a dot); ``join`` puts the item's bytes in each token's place. A data: URL and base64 are
    characters JSON never escapes, so the bytes are exactly what ``json.dumps`` would have written, but
    without it scanning tens of MiB character by character on the event loop (hundreds of ms for a
    limit-size body), and without the base64 ever being a str."""

    def __init__(self) -> None:
        self.prefix = f"epd-splice-{uuid.uuid4().hex}-"
        self.items: list[tuple[bytes, ...]] = []

    def add(self, *chunks: bytes) -> str:
        self.items.append(chunks)
        return f"{self.prefix}{len(self.items) - 1}."

    def join(self, rendered: bytes) -> bytes:
        if not self.items:
            return rendered
        view, key, pieces, start = memoryview(rendered), self.prefix.encode(), [], 0
        while (at := rendered.find(key, start)) >= 0:
            dot = rendered.index(b".", at + len(key))
            pieces += (view[start:at], *self.items[int(rendered[at + len(key):dot])])
            start = dot + 1
        pieces.append(view[start:])
        return b"".join(pieces)
