"""What a request to the gateway is, for every API it serves: the endpoints (``APIS``: each one's
route, where its media are, whether its items go through encoders), the body as the gateway reads it
(``parse_openai``: the API's media reader, vLLM's rule, ``services.gateway.parts``), its media loaded
and hashed (``load_media``), and what each LM attempt's body is made from (``OpenAICall.for_lm``, ``lm_body``). No I/O but
``load_media``'s fetches; no transport (REST: ``openai_api``; gRPC: ``servicer``; both through
``core``)."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from epd.lm.v1 import lm_pb2
from services.common.errors import MediaError
from services.common.media import content_id, off_loop
from services.common.routes import API
from services.gateway.config import GatewayConfig
from services.gateway.errors import ApiError
from services.gateway.fetch import MediaFetcher, load_images
from services.gateway.form import file_span
from services.gateway.intake import BodyLease
from services.gateway.lm_body import LMBody
from services.gateway.parts import MediaPart, PartError, anthropic_media_parts, media_parts
from services.gateway.values import Media

logger = logging.getLogger(__name__)


def loads_strict(raw: bytes) -> Any:
    """A request body as JSON (RFC 8259): unlike ``json.loads`` it refuses the NaN, Infinity and
    -Infinity literals, and a body nested deeper than the interpreter's recursion limit (about 1000
    levels: the parser stops there, so its work stays linear in the body). Raises ApiError (400)."""
    def refuse(literal: str) -> Any:
        raise ValueError(f"{literal} is not a JSON number")

    try:
        return json.loads(raw, parse_constant=refuse)
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError is a ValueError
        raise ApiError(400, f"request body is not valid JSON: {e}") from None
    except RecursionError:
        raise ApiError(400, "request body is not valid JSON here: nested too deeply") from None


RESPONSE_ID_RE = re.compile(r"resp_[0-9a-f]{32}")
"""A Responses request's provisional id (128 random bits, never a client's choice): it marks the call as
one whose id the gateway chooses. The id a client sees is rendered for each LM attempt by
``services.gateway.responses.ResponseIds`` (its home LM and owner under an HMAC); this one stands only
where no LM is named."""


def mint_response_id() -> str:
    return f"resp_{uuid.uuid4().hex}"


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
    attempt's body is rendered from ``for_lm``), where its image parts are, and the images' sources."""

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
    """A Responses request's provisional id (``RESPONSE_ID_RE``; each LM attempt renders the signed one,
    ``services.gateway.responses``): vLLM names and stores the
    response under the body's ``request_id``, so a client that chose it could take over or overwrite
    another's stored response; a body that names one is refused (400)."""
    salt_tenant: str = ""
    """With client keys, the tenant whose prefix-cache namespace a generating request uses (``tenant_salt``),
    and whose embedding namespace its media are named in (``namespace``)."""
    upload: bytes = b""
    """An ``upload`` API's body, as the client sent it (``content_type`` says how it is encoded)."""
    content_type: str = ""
    nbytes: int = 0
    """The size of the JSON body as it arrived: whether the per-body work after the parse (its prefix
    keys) is large enough to leave the event loop for a thread."""

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

    def for_lm(self, media: list[Media] | None = None) -> LMBody:
        """What each LM attempt's body is made from (``LMBody.render``), as this request stands now: the
        client's body (never changed), where its media parts are, the ids and salt the LM gets, and its
        loaded ``media`` (``load_media``'s)."""
        return LMBody(self.api, self.body, self.parts, self.upload, self.request_id, self.id_given,
                      self.response_id, self.salt_tenant, media if media is not None else [], nbytes=self.nbytes)

    def drop_payload(self) -> None:
        """Frees the request's body and media sources once it is answered, whatever still refers to
        this object (a retry closure, a task in a reference cycle)."""
        self.body = {}
        self.upload = b""
        self.sources.clear()

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
    call = OpenAICall(api, body, body.get("stream") is True, nbytes=len(raw))
    if api == "responses":
        if "request_id" in body:
            raise ApiError(400, "request_id: a response's id is chosen by the server (it names the stored "
                                "response that GET, cancel and previous_response_id reach)", param="request_id")
        call.response_id = mint_response_id()
    # More parts than every limit together is refused below, whichever modality is over: no need to read on.
    most = cfg.max_images + cfg.max_audios + cfg.max_videos
    try:
        if spec.media == "anthropic":
            found = anthropic_media_parts(body.get("messages"), most)
        elif spec.media:
            found = media_parts(body.get(spec.media), spec.media, most)
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
                     fetcher: MediaFetcher | None, lease: BodyLease | None = None) -> list[Media]:
    """Loads every media item of ``call`` (data: decoded, http(s) fetched concurrently, every header
    checked), adds one item per image or audio clip to ``req`` in order and returns them as Media.
    ``lease``: the request's share of the body budget, charged for what it fetched. Raises MediaError
    (BodyRefused when the fetched bytes do not fit)."""
    try:
        datas = await load_images(call.sources, cfg, fetcher, call.modalities)
    except MediaError as e:
        logger.info("request %s: media refused (%d): %s", req.request_id, e.status, e)
        raise
    # Fetched media are held as long as the request; its body's share of the budget does not cover them.
    if lease is not None:
        await lease.charge_fetched(sum(len(d) for d, src in zip(datas, call.sources)
                                       if isinstance(src, str) and not src.startswith("data:")))
    media = []
    req.namespace = call.namespace  # the encoders and the LM compute and check identifiers in it
    for data, modality in zip(datas, call.modalities):
        # A large item is hashed on a thread (hashlib releases the GIL): the loop answers others meanwhile.
        ident = await off_loop(len(data), content_id, data, call.namespace)
        if API[call.api].encode:  # else the LM lays the prompt out itself, from the bytes in its body
            req.items.add(modality=modality, identifier=ident)
        media.append(Media(data, ident, modality))
    if API[call.api].upload and call.upload:
        # A speech-to-text upload is one item: the body as the client sent it, which an encoder that cuts
        # speech windows reads by vLLM's rule (services.encoder.speech); with none, the LM reads it alone.
        # Off the loop: hashing up to --max-audio-bytes releases the GIL; the form reading is bounded.
        key = await asyncio.to_thread(upload_key, call.upload, call.content_type, call.namespace)
        req.items.add(modality="audio", identifier=key)
        media.append(Media(call.upload, key, "audio", content_type=call.content_type))
    return media


def upload_key(body: bytes, content_type: str, namespace: str = "") -> str:
    """A speech upload's routing key: ``content_id`` of its ``file`` part (the last one, as FastAPI takes
    it), so the same clip goes to the encoder that holds its windows whatever the form's boundary, field
    order or other fields; of the whole body when no such part is found, or where vLLM's app would refuse
    the form (``services.gateway.form``: a bounded, linear reading). Only routing reads it: the encoder
    names each window by its samples, so a key that differs from the encoder's reading of the body costs
    an encode elsewhere, never a wrong answer. Blocking for a large body (the hash): ``load_media`` runs
    it off the event loop."""
    span = file_span(body, content_type)
    return content_id(memoryview(body)[span[0]:span[1]] if span else body, namespace)
