"""What a request to the gateway is, for every API it serves: the endpoints (``APIS``: each one's
route, where its media are, whether its items go through encoders), the body as the gateway reads it
(``parse_openai``: the API's media reader, vLLM's rule, ``services.gateway.parts``), its media loaded
and hashed (``load_media``), and the body each LM attempt gets (``OpenAICall.lm_body``). No I/O but
``load_media``'s fetches; no transport (REST: ``openai_api``; gRPC: ``servicer``; both through
``core``)."""

from __future__ import annotations

import base64
import copy
import hashlib
import json
import logging
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from epd.lm.v1 import lm_pb2
from services.common.errors import MediaError
from services.common.media import content_id, sniff_audio_format, sniff_video_format
from services.common.routes import API
from services.gateway.config import GatewayConfig
from services.gateway.fetch import MediaFetcher, load_images
from services.gateway.intake import charge_fetched
from services.gateway.orchestrator import Media
from services.gateway.parts import LM_PART, MediaPart, PartError, anthropic_media_parts, media_parts

logger = logging.getLogger(__name__)


class ApiError(Exception):
    """A request answered with an error before (or instead of) an LM's answer: an HTTP status, the
    message, the OpenAI error type and param, and ``retry_after`` (the header's seconds) where coming
    back later helps. The gRPC API answers it with ``core.grpc_code(status)``."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 retry_after: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.retry_after = status, message, type_, param, retry_after


def loads_strict(raw: bytes) -> Any:
    """A request body as JSON (RFC 8259): unlike ``json.loads`` it refuses the NaN, Infinity and
    -Infinity literals. Raises ApiError (400)."""
    def refuse(literal: str) -> Any:
        raise ValueError(f"{literal} is not a JSON number")

    try:
        return json.loads(raw, parse_constant=refuse)
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError is a ValueError
        raise ApiError(400, f"request body is not valid JSON: {e}") from None


RESPONSE_ID_RE = re.compile(r"resp_[0-9a-f]{32}")
"""The ids the gateway mints for Responses requests: 128 random bits, never a client's choice."""


def mint_response_id() -> str:
    return f"resp_{uuid.uuid4().hex}"


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


def tenant_namespace(tenant: str) -> str:
    """The embedding namespace of a tenant's media (``services.common.media.content_id``): ``tenant:``, as
    its prefix-cache salt, so its items' identifiers, and every embedding cache keyed by them, are its
    own; a tenant name holds no ``:``, and the identifier's rule keeps namespaces apart whatever they
    hold. The empty tenant (a gateway without keys) has the empty namespace: identifiers are the SHA-256
    of the bytes, as they always were. A client has no say in it (a client's ``cache_salt`` salts only
    the prefix cache)."""
    return f"{tenant}:" if tenant else ""


def engine_request_id(client_id: str, prefix: str) -> str:
    """The id the encoders and the LM see for one request: the client's ``X-Request-Id`` with a random
    suffix (clients may send the same id twice; an engine needs unique ones, and the client's id still
    finds the request in every service's logs), or ``<prefix>-<uuid>`` without one."""
    return f"{client_id}-{uuid.uuid4().hex[:12]}" if client_id else f"{prefix}-{uuid.uuid4().hex}"


def media_api_error(e: MediaError) -> ApiError:
    """A refused media item as the REST API answers it: 400 or 413, param image_url (audio_url)."""
    return ApiError(e.status, str(e), param=f"{e.modality}_url")


MIME = {"WAV": "audio/wav", "FLAC": "audio/flac", "OGG": "audio/ogg", "MP3": "audio/mpeg",
        "MP4": "video/mp4", "WEBM": "video/webm", "AVI": "video/x-msvideo"}
LIMIT_FLAG = {"image": "max_images", "audio": "max_audios", "video": "max_videos"}
ITEMS = {"image": "images", "audio": "audio clips", "video": "videos"}
MEDIA_REF = "epd-media:"  # gRPC API: an image_url/audio_url that names OpenAIRequest.media[N]


SCALE_OUT_PATHS: tuple[str, ...] = (
    "/v1/chat/completions/render", "/v1/completions/render", "/v1/messages/render", "/v1/responses/render",
    "/v1/chat/completions/derender", "/v1/completions/derender", "/inference/v1/generate",
    "/inference/v1/abort_requests")
"""vLLM's scale-out routes (POST): `vllm serve` without ``--enable-scale-out`` answers each with a 403
(``SCALE_OUT_DISABLED``), and so does the gateway, itself, before reading a body: epd-serve is the
disaggregated front end, and no LM serves them."""
SCALE_OUT_DISABLED = "Scale-out endpoints are disabled. Restart vllm serve with --enable-scale-out to enable them."
"""vLLM's message for them (``vllm/entrypoints/scale_out/factories.py``), word for word."""


@dataclass
class OpenAICall:
    """One OpenAI request on its way through the gateway: the client's body (never changed; each LM
    attempt gets a copy from ``lm_body``), where its image parts are, and the images' sources."""

    api: str  # a name in APIS
    body: dict[str, Any]
    stream: bool
    parts: list[MediaPart] = field(default_factory=list)  # where each media item is, in order
    sources: list[str | bytes] = field(default_factory=list)  # the items' URLs (or gRPC media bytes)
    modalities: list[str] = field(default_factory=list)  # each item's: "image", "audio" or "video"
    request_id: str = ""
    """The request's id in the LM's body: vLLM names its response ``chatcmpl-<id>`` / ``cmpl-<id>``
    from it. As with ``vllm serve``, the client's X-Request-Id wins (``id_given``); else the body's
    own ``request_id``; else this one, made by the gateway."""
    id_given: bool = False
    response_id: str = ""
    """A Responses request's id, minted by the gateway (``RESPONSE_ID_RE``): vLLM names and stores the
    response under the body's ``request_id``, so a client that chose it could take over or overwrite
    another's stored response; a body that names one is refused (400)."""
    salt_tenant: str = ""
    """With client keys, the tenant whose prefix-cache namespace a generating request uses (``tenant_salt``),
    and whose embedding namespace its media are named in (``namespace``)."""
    upload: bytes = b""
    """An ``upload`` API's body, as the client sent it (``content_type`` says how it is encoded)."""
    content_type: str = ""

    @property
    def namespace(self) -> str:
        """The embedding namespace of the request's media (``tenant_namespace``; empty without keys)."""
        return tenant_namespace(self.salt_tenant)

    def one_engine_call(self) -> bool:
        """Whether the LM answers this request with one engine call, as E -> P -> D needs (the prefill LM
        computes one token of it; the decode LM loads that call's KV). Beam search calls the engine once
        per beam per step, and a background Responses request outlives its call: either goes to one LM
        whole. Read loosely (any truthy value): a value vLLM would read as false then only costs the
        split, and the LM refuses a second engine call in a hand-off anyway."""
        return not (self.body.get("use_beam_search") or self.body.get("background"))

    def drop_payload(self) -> None:
        """Frees the request's body and media sources once it is answered, whatever still refers to
        this object (a retry closure, a task in a reference cycle)."""
        self.body = {}
        self.upload = b""
        self.sources.clear()

    def lm_body(self, req: lm_pb2.GenerateRequest, media: list[Media]) -> bytes:
        """The body for one LM attempt: each item an encoder laid out becomes a uuid-only part (the
        LM never sees its bytes); any other item a data: URL of the bytes the gateway read (the LM
        never downloads), with its content hash as uuid when an encoder has its embedding. Audio goes
        as vLLM's ``audio_url`` part (an ``input_audio`` part too). An upload goes as it came."""
        if API[self.api].upload:
            return self.upload
        body = copy.deepcopy(self.body) if self.parts else dict(self.body)
        spec = API[self.api]
        if self.request_id and spec.lm_api != "http" and (self.id_given or not body.get("request_id")):
            body["request_id"] = self.request_id
        if self.response_id:
            body["request_id"] = self.response_id
        if self.salt_tenant and spec.generates:
            body["cache_salt"] = tenant_salt(self.salt_tenant, body.get("cache_salt"))
        items = list(req.items) if spec.encode else [None] * len(media)
        # The LM lays a prompt out from the encoders' layouts only when every item has one; else its
        # processor lays the whole prompt out and needs every item's bytes.
        laid_out = spec.encode and all(item.source.placeholder_token_ids for item in req.items)
        for p, item, m in zip(self.parts, items, media):
            data_url = None if laid_out else _data_url(m)
            ident = item.identifier if item is not None and (laid_out or item.HasField("source")) else None
            if spec.media == "anthropic":
                # vLLM's converter drops any uuid: the LM knows an encoder's image by its content hash.
                block = body["messages"][p.message]["content"][p.part]
                if p.inner >= 0:
                    block = block["content"][p.inner]
                block["source"] = {"type": "base64", "media_type": "image/png",
                                   "data": base64.b64encode(m.data).decode()}
                continue
            if spec.media == "input":
                # The bytes go too, even for an item an encoder laid out (the LM knows it by its hash
                # and does not decode it): vLLM stores a response's input as given, and a follow-up
                # (previous_response_id) renders it again, with no encoder named for it then. The part
                # keeps its kind: vLLM's request model takes a chat part only where it took the client's.
                if p.kind == "input_image":
                    part: dict[str, Any] = {"type": "input_image", "image_url": _data_url(m)}
                    given = body[p.container][p.message][p.key][p.part]
                    if isinstance(given, dict) and "detail" in given:
                        part["detail"] = given["detail"]  # vLLM requires it of a tool output's image
                else:
                    kind = p.kind if p.kind != "input_audio" else "audio_url"
                    part = {"type": kind, kind: {"url": _data_url(m)}}
            else:
                kind = LM_PART[m.modality]
                part = {"type": kind, kind: None if data_url is None else {"url": data_url}}
            if ident is not None:
                part["uuid"] = ident  # else the LM encodes it itself and hashes it as vLLM does
            body[p.container][p.message][p.key][p.part] = part
        return json.dumps(body, ensure_ascii=False).encode()


def _data_url(m: Media) -> str:
    if m.modality == "image":
        mime = "image/png"  # the LM's image decoder sniffs the format
    else:
        sniffed = sniff_audio_format(m.data) if m.modality == "audio" else sniff_video_format(m.data)
        mime = MIME.get(sniffed or "", f"{m.modality}/octet-stream")
    return f"data:{mime};base64," + base64.b64encode(m.data).decode()


MAX_CONTENT_TYPE = 256


def multipart_upload(fields: dict[str, Any], file: bytes) -> tuple[bytes, str]:
    """The ``multipart/form-data`` body (and its Content-Type) a REST client would send for an upload
    API: ``fields`` (the gRPC API's JSON body: strings, numbers, booleans, lists of those) as form
    fields, a list as repeated ``name[]`` fields (OpenAI's and vLLM's form names, e.g.
    ``timestamp_granularities[]``), and ``file`` as the ``file`` part. Raises ApiError."""
    boundary = "epd-" + uuid.uuid4().hex
    parts: list[bytes] = []

    def field(name: str, value: Any) -> None:
        if isinstance(value, bool):
            value = "true" if value else "false"
        elif not isinstance(value, str | int | float) or value != value:
            raise ApiError(400, f"form field {name!r} must be a string, a number, a boolean or a list of those")
        if any(c in name for c in '"\r\n') or len(name) > 100:
            raise ApiError(400, "form field names are at most 100 characters, without quotes or line breaks")
        parts.append(f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"\r\n\r\n{value}\r\n'.encode())

    for name, value in fields.items():
        if name == "file":
            raise ApiError(400, "the file is media[0], not a field of the body")
        for v in value if isinstance(value, list) else [value]:
            field(name if not isinstance(value, list) or name.endswith("[]") else name + "[]", v)
    parts.append(f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="audio"\r\n'
                 f"Content-Type: application/octet-stream\r\n\r\n".encode() + file + b"\r\n")
    parts.append(f"--{boundary}--\r\n".encode())
    return b"".join(parts), f"multipart/form-data; boundary={boundary}"


def parse_upload(api: str, raw: bytes, content_type: str) -> OpenAICall:
    """An ``upload`` API's request: the body is kept as it came, for vLLM's app on the LM to parse
    (it answers a malformed one as `vllm serve` does). The gateway reads only its Content-Type, which
    travels with it: one header line of printable ASCII. Whether the answer streams, the LM's answer
    says (its Content-Type). Raises ApiError."""
    if len(content_type) > MAX_CONTENT_TYPE or not content_type.isascii() or not content_type.isprintable():
        raise ApiError(400, f"Content-Type must be one line of at most {MAX_CONTENT_TYPE} printable ASCII "
                            "characters (multipart/form-data; boundary=...)")
    return OpenAICall(api, {}, False, upload=raw, content_type=content_type)


def parse_openai(api: str, raw: bytes, cfg: GatewayConfig, media: list[bytes] | None = None,
                 content_type: str = "") -> OpenAICall:
    """Reads what the gateway needs from a request body, without I/O: whether it streams, and where its
    media are, found by vLLM's own rule (``services.gateway.parts``). Everything else is vLLM's to
    validate (on the LM). ``media``: the gRPC API's raw media, named by ``epd-media:N`` URLs;
    ``content_type``: the request's, for an ``upload`` API (``parse_upload``). Raises ApiError."""
    spec = API[api]
    if spec.upload and media is not None:  # the gRPC API: the form's fields as JSON, the file as media[0]
        fields = loads_strict(raw) if raw else {}
        if not isinstance(fields, dict) or len(media) != 1:
            raise ApiError(400, "an audio request is the form's fields as a JSON object and the file as media[0]")
        raw, content_type = multipart_upload(fields, media[0])
    if spec.upload:
        return parse_upload(api, raw, content_type)
    body = loads_strict(raw) if raw or spec.method != "GET" else {}
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object")
    call = OpenAICall(api, body, body.get("stream") is True)
    if api == "responses":
        if "request_id" in body:
            raise ApiError(400, "request_id: a response's id is chosen by the server (it names the stored "
                                "response that GET, cancel and previous_response_id reach)", param="request_id")
        call.response_id = mint_response_id()
    try:
        if spec.media == "anthropic":
            found = anthropic_media_parts(body.get("messages"))
        elif spec.media:
            found = media_parts(body.get(spec.media), spec.media)
        else:
            found = []
    except PartError as e:
        raise ApiError(400, str(e), param=spec.media) from None
    for p in found:
        limit = getattr(cfg, LIMIT_FLAG[p.modality])
        if call.modalities.count(p.modality) >= limit:
            raise ApiError(400, f"at most {limit} {ITEMS[p.modality]} per request (--max-{p.modality}s)",
                           param=spec.media)
        call.modalities.append(p.modality)
        if p.source.startswith(MEDIA_REF):
            k = p.source[len(MEDIA_REF):]
            if media is None or not k.isdigit() or int(k) >= len(media):
                raise ApiError(400, f"{p.where}: {p.source!r} names no media item", param=spec.media)
            call.sources.append(media[int(k)])
        else:
            call.sources.append(p.source)
        call.parts.append(p)
    return call


async def load_media(call: OpenAICall, req: lm_pb2.GenerateRequest, cfg: GatewayConfig,
                     fetcher: MediaFetcher | None) -> list[Media]:
    """Loads every media item of ``call`` (data: decoded, http(s) fetched concurrently, every header
    checked), adds one item per image or audio clip to ``req`` in order and returns them as Media.
    Raises MediaError."""
    try:
        datas = await load_images(call.sources, cfg, fetcher, call.modalities)
    except MediaError as e:
        logger.info("request %s: media refused (%d): %s", req.request_id, e.status, e)
        raise
    # Fetched media are held as long as the request; its body's share of the budget does not cover them.
    await charge_fetched(sum(len(d) for d, src in zip(datas, call.sources)
                             if isinstance(src, str) and not src.startswith("data:")))
    media = []
    req.namespace = call.namespace  # the encoders and the LM compute and check identifiers in it
    for data, modality in zip(datas, call.modalities):
        ident = content_id(data, call.namespace)
        if API[call.api].encode:  # else the LM lays the prompt out itself, from the bytes in its body
            req.items.add(modality=modality, identifier=ident)
        media.append(Media(data, ident, modality))
    return media


