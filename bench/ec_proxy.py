"""A tiny proxy in front of vLLM's own encoder disaggregation (the ``vllm-ec``
system of ``bench/serving.py``), driven the way upstream's example proxy
(vLLM ``examples/online_serving/disaggregated_encoder/disagg_epd_proxy.py``)
drives it: sequentially.

For a chat request that carries an image, the proxy first POSTs the request to
the producer (an ``ec_producer`` vLLM OpenAI server: it encodes, writes the
encoder output to ``ECExampleConnector``'s shared directory, and answers one
token), waits for that answer, then sends the original request to the consumer
(an ``ec_consumer`` server, which finds the file by the image's hash and skips
its own vision encoder) and streams its answer back. Text requests go straight
to the consumer. ``GET /stats`` returns the producer (and prefill) round trips it timed.

With ``--prefill`` (the ``vllm-epd`` system: upstream's 1e1p1d) the consumer is a decode server: after
the encode, the request goes to the prefill server (an ``ec_consumer`` + ``kv_producer``) with
``max_tokens`` 1 and ``kv_transfer_params`` asking for a remote decode, and then to the decode server
with the ``kv_transfer_params`` the prefill answered, as upstream's ``disagg_epd_proxy.py`` does.

    python bench/ec_proxy.py --port P --producer http://127.0.0.1:A --consumer http://127.0.0.1:B --model M
    python bench/ec_proxy.py --port P --producer URL_E --prefill URL_P --consumer URL_D --model M
"""

from __future__ import annotations

import argparse
import copy
import time

import aiohttp
from aiohttp import web


def has_media(body: dict) -> bool:
    return any(isinstance(m.get("content"), list) and
               any(p.get("type") in ("image_url", "audio_url", "input_audio") for p in m["content"])
               for m in body.get("messages", []))


REMOTE_DECODE = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                 "remote_block_ids": None, "remote_host": None, "remote_port": None}


def one_token(body: dict) -> dict:
    """The request as a producer or prefill server gets it: one token, not streamed."""
    out = copy.deepcopy(body)
    out.update(max_tokens=1, stream=False)
    out.pop("stream_options", None)
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    return out


class ProxyBase:
    """What this proxy and ``mooncake_proxy``'s share: the HTTP session to the servers (made on the app's
    start, closed on its cleanup: its only resource), the consumer's model list and the health route.
    A subclass adds ``chat`` and ``stats`` (``serve`` routes them)."""

    def __init__(self, consumer: str) -> None:
        self.consumer = consumer
        self.session: aiohttp.ClientSession | None = None
        self.encode_s: list[float] = []
        self.failed = 0

    async def start(self, app: web.Application) -> None:
        # No total limit: the client owns the deadline (as in upstream's proxy).
        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None),
                                             connector=aiohttp.TCPConnector(limit=0))

    async def stop(self, app: web.Application) -> None:
        if self.session is not None:
            await self.session.close()

    async def models(self, request: web.Request) -> web.Response:
        """The consumer's model list: what a client (``vllm bench serve``) asks first."""
        async with self.session.get(f"{self.consumer}/v1/models") as r:
            return web.Response(status=r.status, body=await r.read(), content_type="application/json")

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(text="ok")


class Proxy(ProxyBase):
    def __init__(self, producer: str, consumer: str, model: str, prefill: str = "") -> None:
        super().__init__(consumer)
        self.producer, self.model, self.prefill = producer, model, prefill
        self.prefill_s: list[float] = []

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        body["model"] = self.model
        if has_media(body):
            t0 = time.perf_counter()
            async with self.session.post(f"{self.producer}/v1/chat/completions", json=one_token(body)) as r:
                text = await r.text()
                if r.status != 200:
                    self.failed += 1
                    return web.Response(status=r.status, text=text, content_type="application/json")
            self.encode_s.append(time.perf_counter() - t0)
        if self.prefill:
            pre = {**one_token(body), "kv_transfer_params": REMOTE_DECODE}
            t0 = time.perf_counter()
            async with self.session.post(f"{self.prefill}/v1/chat/completions", json=pre) as r:
                if r.status != 200:
                    self.failed += 1
                    return web.Response(status=r.status, body=await r.read(), content_type="application/json")
                params = (await r.json()).get("kv_transfer_params")
            self.prefill_s.append(time.perf_counter() - t0)
            if params:
                body["kv_transfer_params"] = params
        async with self.session.post(f"{self.consumer}/v1/chat/completions", json=body) as r:
            if r.status != 200 or not body.get("stream"):
                return web.Response(status=r.status, body=await r.read(), content_type="application/json")
            out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await out.prepare(request)
            async for chunk in r.content.iter_any():
                await out.write(chunk)
            await out.write_eof()
            return out

    async def stats(self, request: web.Request) -> web.Response:
        return web.json_response({"encode_s_sum": sum(self.encode_s), "encode_count": len(self.encode_s),
                                  "prefill_s_sum": sum(self.prefill_s), "prefill_count": len(self.prefill_s),
                                  "failed": self.failed})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--producer", required=True, help="base URL of the ec_producer vLLM server")
    ap.add_argument("--consumer", required=True, help="base URL of the ec_consumer (with --prefill: the decode) "
                                                      "vLLM server")
    ap.add_argument("--prefill", default="", help="base URL of an ec_consumer + kv_producer vLLM server: "
                                                  "E -> P -> D, the consumer then being a kv_consumer")
    ap.add_argument("--model", required=True, help="model name both servers serve")
    args = ap.parse_args()
    serve(Proxy(args.producer.rstrip("/"), args.consumer.rstrip("/"), args.model, args.prefill.rstrip("/")),
          args.host, args.port)


def serve(proxy, host: str, port: int) -> None:
    """Serves a proxy's routes (``chat``, ``models``, ``stats``, ``health``, ``start``/``stop`` around them)
    until interrupted: this one's, and ``mooncake_proxy``'s."""
    app = web.Application(client_max_size=64 << 20)
    app.on_startup.append(proxy.start)
    app.on_cleanup.append(proxy.stop)
    app.router.add_post("/v1/chat/completions", proxy.chat)
    app.router.add_get("/v1/models", proxy.models)
    app.router.add_get("/stats", proxy.stats)
    app.router.add_get("/health", proxy.health)
    web.run_app(app, host=host, port=port, print=None)


if __name__ == "__main__":
    main()
