"""A proxy in front of vLLM's Mooncake encoder disaggregation (the ``vllm-mooncake`` system of
``bench/serving.py``): the E + PD choreography of upstream's proxy (vLLM's
``examples/disaggregated/disaggregated_encoder/disagg_epd_proxy.py``, run as vLLM's
``ECMooncakeConnector`` guide runs it: ``--prefill-servers-urls disable --ec-consumer-zmq-addrs
tcp://EC_IP:EC_PORT``), which vLLM's wheel does not ship.

For a chat request that carries images:

1. One request to the encoder (an ``ec_producer`` vLLM server: encoder-only, it finishes once the
   prompt is encoded and never samples) with every image of the request and no text, each image with
   a ``uuid`` (the sha256 of its URL: a content key, so a repeated image keeps its cache key), and
   ``ec_transfer_params`` = ``{"consumer_zmq": <the consumer's Mooncake control address>,
   "ec_items": [{"transfer_id": <fresh>}, ...]}``, one id per image in order. The producer reserves
   room in the consumer's registered buffer over that ZMQ address and writes each encoder output
   into it with Mooncake's transfer engine.
2. The encoder's answer carries ``ec_transfer_params``: per ``mm_hash`` the item positions
   (``item_indices``) and the ``metadata`` the model's parser declares as sizing an item's
   placeholders (``image_grid_thw`` for Qwen-VL; nothing for Idefics3). The consumer's body gets the
   encoder's entries and, as upstream's ``rewrite_for_decode``, each image with metadata rewritten to
   ``image_embeds`` (that metadata and the uuid, no pixels) and named in
   ``ec_transfer_params.ec_items`` (``{"mm_hash", "transfer_id"}``: the consumer matches a push by
   it); an image without metadata goes as sent, unnamed. With ``--no-rewrite`` (upstream's switch of
   the same name) every image goes as sent, without a uuid (so the consumer's hash of it equals the
   encoder's), and every one is named in ``ec_items``.
3. The consumer (an ``ec_consumer`` server with ``--enable-mm-embeds``) answers; a 500 before its
   first byte (its retryable error, e.g. a push that never came) re-encodes and retries once, as
   upstream's ``--decode-retries 1``.

Text requests go straight to the consumer. The proxy holds no tensors: the consumer owns its
registered buffer and frees a reservation when the request that named its transfer id finishes.
``GET /stats`` returns the encoder round trips it timed.

    python bench/mooncake_proxy.py --port P --encoder http://127.0.0.1:A --consumer http://127.0.0.1:B \\
        --consumer-zmq tcp://127.0.0.1:C --model M [--no-rewrite]
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import time
import uuid

from aiohttp import web
from ec_proxy import ProxyBase, serve

MM_TYPES = ("image_url", "audio_url", "input_audio", "video_url")
# What each media item becomes once its encoder output travels out of band (upstream's EMBEDS_TYPES).
EMBEDS_TYPES = {"image_url": "image_embeds", "audio_url": "audio_embeds", "input_audio": "audio_embeds",
                "video_url": "video_embeds"}
# Request fields the encoder also needs (they change how it processes the media), as upstream copies.
ENCODER_KEYS = ("mm_processor_kwargs", "media_io_kwargs", "priority", "session_id")
CONTROL_FIELDS = ("mm_hash", "ec_mm_hash", "transfer_id")


class EncoderError(Exception):
    """The encoder refused or broke a request: ``status`` and ``text`` go back to the client."""

    def __init__(self, status: int, text: str) -> None:
        super().__init__(text)
        self.status, self.text = status, text


def media_items(body: dict) -> list[dict]:
    """Every media item of the request's messages, in order."""
    return [item for m in body.get("messages", []) if isinstance(m.get("content"), list)
            for item in m["content"] if item.get("type") in MM_TYPES]


def content_uuid(item: dict) -> str:
    """The cache key of a media item: the sha256 of its URL (of the item itself when it has none)."""
    url = (item.get("image_url") or item.get("audio_url") or item.get("video_url") or {}).get("url") or ""
    return hashlib.sha256((url or json.dumps(item, sort_keys=True)).encode()).hexdigest()


def encoder_request(body: dict, items: list[dict], consumer_zmq: str, transfer_ids: list[str],
                    rewrite: bool) -> dict:
    """The one request the encoder gets for ``items`` (all of a request's images: one encoder, one
    group): the items alone, each with its uuid unless ``rewrite`` is off, and the transfer ids the
    producer pushes under, by position."""
    content = [item if not rewrite else {**item, "uuid": item.get("uuid") or content_uuid(item)} for item in items]
    out = {"model": body.get("model"), "messages": [{"role": "user", "content": content}], "stream": False,
           "ec_transfer_params": {"consumer_zmq": consumer_zmq,
                                  "ec_items": [{"transfer_id": t} for t in transfer_ids]}}
    out.update({k: body[k] for k in ENCODER_KEYS if k in body})
    return out


def match_encoder_params(params: dict, items: list[dict], transfer_ids: list[str], rewrite: bool) -> dict[int, dict]:
    """Per item index, what the encoder reported for it (``metadata`` keys) plus ``mm_hash`` (the uuid
    the proxy gave it, else the encoder's hash), ``ec_mm_hash`` (the encoder's hash) and
    ``transfer_id``. Items are matched by the encoder's ``item_indices``, else (one item) by the uuid
    or the only entry. ValueError when the answer cannot be matched."""
    by_index: dict[int, tuple[str, dict]] = {}
    if len(items) > 1:
        for mm_hash, reported in params.items():
            for i in reported.get("item_indices", []):
                if type(i) is not int or not 0 <= i < len(items) or i in by_index:
                    raise ValueError(f"bad encoder item index {i!r}")
                by_index[i] = (mm_hash, reported)
    out = {}
    for i, item in enumerate(items):
        key = (item.get("uuid") or content_uuid(item)) if rewrite else None
        matched = by_index.get(i)
        if matched is None:
            if key in params:
                matched = (key, params[key])
            elif len(items) == 1 and len(params) == 1:
                matched = next(iter(params.items()))
            else:
                raise ValueError("encoder metadata cannot be matched")
        ec_mm_hash, reported = matched
        out[i] = {**(reported.get("metadata") or {}), "mm_hash": key or ec_mm_hash, "ec_mm_hash": ec_mm_hash,
                  "transfer_id": transfer_ids[i]}
    return out


def consumer_body(body: dict, item_meta: dict[int, dict], encoder_params: dict, rewrite: bool) -> dict:
    """The body the consumer gets: a new dict (``body`` is left as it was, so a retry starts from the
    original media), with the encoder's ``ec_transfer_params`` entries. Rewritten (upstream's
    ``rewrite_for_decode``): an item with metadata becomes ``{"type": "image_embeds", "image_embeds":
    <metadata, per-item lists flattened>, "uuid": ...}`` and its ``{mm_hash, transfer_id}`` goes in
    ``ec_transfer_params.ec_items``; an item without metadata stays as it was, unnamed (upstream sends
    the media so the consumer can size it). ``rewrite`` off: every item stays and every matched item
    is named in ``ec_items``."""
    messages, named, i = [], [], 0
    for msg in body.get("messages", []):
        content = msg.get("content")
        if not isinstance(content, list):
            messages.append(msg)
            continue
        new = []
        for item in content:
            if item.get("type") not in MM_TYPES:
                new.append(item)
                continue
            meta = dict(item_meta.get(i) or {})
            i += 1
            ids = {k: meta.pop(k, None) for k in CONTROL_FIELDS}
            name = ({"mm_hash": ids["ec_mm_hash"] or ids["mm_hash"], "transfer_id": ids["transfer_id"]}
                    if ids["transfer_id"] is not None else None)
            if not rewrite or not meta or not ids["mm_hash"]:
                new.append(item)
                if not rewrite and name:
                    named.append(name)
                continue
            kind = EMBEDS_TYPES[item["type"]]
            flat = {k: [x for v in vs for x in (v if isinstance(v, list) else [v])] for k, vs in meta.items()}
            new.append({"type": kind, kind: flat, "uuid": ids["mm_hash"]})
            if name:
                named.append(name)
        messages.append({**msg, "content": new})
    params = {**(body.get("ec_transfer_params") or {}), **encoder_params}
    if named:
        params["ec_items"] = named
    return {**body, "messages": messages, **({"ec_transfer_params": params} if params else {})}


class Proxy(ProxyBase):
    """One encoder, one consumer (E + PD). Owns its HTTP session (``ProxyBase``) and nothing else."""

    def __init__(self, encoder: str, consumer: str, consumer_zmq: str, model: str, rewrite: bool = True,
                 retries: int = 1) -> None:
        super().__init__(consumer)
        self.encoder, self.consumer_zmq, self.model = encoder, consumer_zmq, model
        self.rewrite, self.retries = rewrite, retries
        self.retried = 0

    async def prepare(self, body: dict) -> dict:
        """Encode (when the request has media) and build the consumer's body; EncoderError on failure."""
        items = media_items(body)
        if not items:
            return body
        ids = [uuid.uuid4().hex for _ in items]
        t0 = time.perf_counter()
        req = encoder_request(body, items, self.consumer_zmq, ids, self.rewrite)
        async with self.session.post(f"{self.encoder}/v1/chat/completions", json=req) as r:
            text = await r.text()
            if r.status != 200:
                raise EncoderError(r.status, text)
        self.encode_s.append(time.perf_counter() - t0)
        params = json.loads(text).get("ec_transfer_params") or {}
        try:
            meta = match_encoder_params(params, items, ids, self.rewrite) if params else {}
        except ValueError as e:
            raise EncoderError(502, str(e)) from None
        return consumer_body(body, meta, params, self.rewrite)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        body["model"] = self.model
        for attempt in range(self.retries + 1):
            try:
                prepared = await self.prepare(copy.deepcopy(body))
            except EncoderError as e:
                self.failed += 1
                return web.Response(status=e.status, text=e.text, content_type="application/json")
            async with self.session.post(f"{self.consumer}/v1/chat/completions", json=prepared) as r:
                if r.status == 500 and attempt < self.retries:  # before any byte reached the client
                    self.retried += 1
                    await r.read()
                    continue
                if r.status != 200 or not body.get("stream"):
                    return web.Response(status=r.status, body=await r.read(), content_type="application/json")
                out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
                await out.prepare(request)
                async for chunk in r.content.iter_any():
                    await out.write(chunk)
                await out.write_eof()
                return out
        raise AssertionError("unreachable")

    async def stats(self, request: web.Request) -> web.Response:
        return web.json_response({"encode_s_sum": sum(self.encode_s), "encode_count": len(self.encode_s),
                                  "failed": self.failed, "retried": self.retried})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--encoder", required=True, help="base URL of the ec_producer vLLM server")
    ap.add_argument("--consumer", required=True, help="base URL of the ec_consumer (prefill + decode) vLLM server")
    ap.add_argument("--consumer-zmq", required=True, help="the consumer's Mooncake control address, "
                                                          "tcp://EC_IP:EC_PORT of its --ec-transfer-config")
    ap.add_argument("--model", required=True, help="model name both servers serve")
    ap.add_argument("--no-rewrite", action="store_true", help="send images to the consumer unchanged")
    ap.add_argument("--decode-retries", type=int, default=1, help="re-encode and resend on a consumer 500")
    args = ap.parse_args()
    serve(Proxy(args.encoder.rstrip("/"), args.consumer.rstrip("/"), args.consumer_zmq, args.model,
                rewrite=not args.no_rewrite, retries=max(0, args.decode_retries)), args.host, args.port)


if __name__ == "__main__":
    main()
