"""Encode fan-out: one attempt's media items grouped by the encoder each maps to (``routing``'s cache
affinity) and by modality, one ``Encode`` stream per group, each item's ``ItemSource`` copied into the
LM's request as its metadata arrives, and the streams' ends (left to end when the LM has answered,
cancelled when it has not).

Owner: the ``Orchestrator`` makes one ``Encodes``; it holds the streams of answered requests that are
still ending (``close`` cancels them). An ``EncodeGroup`` lives for one attempt."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

import grpc
from prometheus_client import Counter

from epd.encoder.v1 import encoder_pb2
from services.gateway.config import GatewayConfig
from services.gateway.failures import Failure, rpc_error
from services.gateway.fleet import Fleet
from services.gateway.instances import Instance
from services.gateway.values import Media, Timings

logger = logging.getLogger(__name__)

MAX_WINDOWS = 256
"""The most windows one speech upload may become (Whisper's 30 s each: two hours of audio); an encoder that
says more is at fault."""

LOCAL_FALLBACK = Counter("epd_gateway_local_encode_fallback_total",
                         "Requests whose items the LM encoded itself because no encoder was healthy")


@dataclass(eq=False)
class EncodeGroup:
    """One Encode call: the items of a request that go to one encoder."""

    inst: Instance
    indices: list[int]
    metadata: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    task: asyncio.Task | None = None

    def failure(self) -> Failure | None:
        t = self.task
        if t is None or not t.done() or t.cancelled():
            return None
        e = t.exception()
        return e if isinstance(e, Failure) else None


class Encodes:
    def __init__(self, cfg: GatewayConfig, fleet: Fleet) -> None:
        self.cfg, self.fleet = cfg, fleet
        self._draining: set[asyncio.Task] = set()  # encode streams of answered requests, ending on their own

    def plan(self, media: list[Media], excluded: set[str], rid: str) -> list[EncodeGroup]:
        """Items grouped by the encoder each one maps to and by modality (an Encode call
        carries one modality); none when no encoder is healthy and the LM may encode itself."""
        encoders = self.fleet.encoders
        by_inst: dict[tuple[Instance, str], list[int]] = {}
        candidates = encoders.healthy(excluded)
        if any(m.content_type for m in media):
            # A speech upload goes to an encoder that cuts it into windows; with none, the LM reads it
            # itself, as it did before encoders could (no error: plain vLLM's path).
            candidates = [i for i in candidates if i.speech_windows]
            if not candidates:
                return []
        for i, m in enumerate(media):
            inst = self.fleet.pick_encoder(m.identifier, candidates)
            if inst is None:
                if not self.cfg.local_encode_fallback:
                    out = "; ".join(f"{i.address}: " + ("failed this request" if i.healthy
                                                         else f"{i.state.value}: {i.reason}")
                                    for i in encoders.instances.values() if i not in candidates)
                    raise Failure(rpc_error(grpc.StatusCode.UNAVAILABLE, "no healthy encoder instance"
                                            + (f" ({out})" if out else "")), "encoder", [], retryable=False)
                LOCAL_FALLBACK.inc()
                logger.warning("request %s: no healthy encoder; the LM encodes its %d item(s) itself",
                               rid, len(media))
                return []
            by_inst.setdefault((inst, m.modality), []).append(i)
            if m.identifier:
                # Held from now on: a concurrent request with the same image joins this encode there (the
                # encoder shares it) instead of encoding it a second time elsewhere. One that fails costs a
                # miss (retries exclude the encoder), never a wrong answer.
                self.fleet.encoded(inst, [m.identifier])
        return [EncodeGroup(inst, idx) for (inst, _), idx in by_inst.items()]

    async def start(self, req, media, groups: list[EncodeGroup], timings: Timings,
                    deadline: float, readers: int = 1) -> None:
        """Starts one Encode per group and returns once every item's metadata
        (and so its source) is in ``req``; in sequential dispatch, once every
        item is encoded."""
        enc_deadline = min(deadline, time.monotonic() + self.cfg.encode_timeout_s)
        for g in groups:
            g.task = asyncio.get_running_loop().create_task(self._encode(g, req, media, timings, enc_deadline,
                                                                         readers))
        timings.encoders = list(dict.fromkeys(g.inst.address for g in groups))
        waits = [g.task for g in groups] if self.cfg.dispatch == "sequential" else [g.metadata for g in groups]
        await asyncio.gather(*waits)
        timings.metadata_ms = timings.since_start_ms()  # of the attempt that goes on

    async def _encode(self, g: EncodeGroup, req, media, timings: Timings, enc_deadline: float,
                      readers: int = 1) -> None:
        """One Encode stream: fills sources from the metadata, then drains the
        "encoded" events. Any failure becomes a Failure blaming this encoder."""
        # An upload's identifier is a routing key, not its body's content hash: the encoder names its windows.
        items = [encoder_pb2.MediaItem(modality=media[i].modality, data=media[i].data,
                                       identifier="" if media[i].content_type else media[i].identifier,
                                       upload_content_type=media[i].content_type) for i in g.indices]
        with g.inst.track():
            call = g.inst.stub.Encode(encoder_pb2.EncodeRequest(request_id=req.request_id, items=items,
                                                                readers=readers if readers > 1 else 0,
                                                                namespace=req.namespace),
                                      timeout=max(0.001, enc_deadline - time.monotonic()))
            try:
                await self._events(g, call, req, timings, len(items))
            except Exception as e:  # noqa: BLE001 - every failure of the stream blames this encoder
                failure = Failure(self._as_rpc_error(e, g, req), "encoder", [g.inst])
                if not g.metadata.done():
                    g.metadata.set_exception(failure)
                raise failure from None
            finally:
                call.cancel()

    @staticmethod
    async def _events(g: EncodeGroup, call, req, timings: Timings, n_items: int) -> None:
        """Fills ``req``'s items from the stream's metadata. A speech upload (one item) may become several:
        window 0 is the upload's own item, each further window an item added after the request's items;
        an upload the encoder cannot read (``windows`` 0) keeps its item without a source (the LM reads
        the upload itself) and has no encoded event to wait for."""
        seen = encoded = dropped = 0
        windows: dict[int, int] = {}  # an upload item's index -> the windows it became
        expected = n_items
        async for ev in call:
            if ev.WhichOneof("event") == "metadata":
                md = ev.metadata
                if not md.HasField("source"):  # an upload the encoder left to the LM: nothing to encode
                    dropped += 1
                else:
                    if md.windows:
                        if md.windows > MAX_WINDOWS or md.window >= md.windows \
                                or windows.setdefault(md.index, md.windows) != md.windows:
                            raise rpc_error(grpc.StatusCode.INTERNAL, f"encoder {g.inst.address} sent window "
                                                                      f"{md.window} of {md.windows}")
                    item = req.items.add(modality=md.modality) if md.window else req.items[g.indices[md.index]]
                    item.identifier = md.identifier
                    item.source.CopyFrom(md.source)  # the encoder's descriptor, as it came
                    seen += 1
                expected = n_items - dropped + sum(w - 1 for w in windows.values())
                if seen >= expected and not g.metadata.done():
                    g.metadata.set_result(None)
            else:
                encoded += 1
                timings.encode_ms = max(timings.encode_ms, ev.encoded.encode_ms)
        n_items = expected
        if encoded < n_items:
            raise rpc_error(grpc.StatusCode.INTERNAL, f"encoder {g.inst.address} ended the stream after "
                                                      f"{seen} metadata and {encoded} encoded events "
                                                      f"for {n_items} item(s)")

    def _as_rpc_error(self, e: Exception, g: EncodeGroup, req) -> grpc.aio.AioRpcError:
        if not isinstance(e, grpc.aio.AioRpcError):
            logger.exception("request %s: encoder %s stream failed", req.request_id, g.inst.address)
            return rpc_error(grpc.StatusCode.INTERNAL, f"encoder {g.inst.address}: {type(e).__name__} "
                                                       "(the gateway's log has the traceback)")
        if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
            return rpc_error(e.code(), f"encoder {g.inst.address} did not encode within "
                                       f"{self.cfg.encode_timeout_s:g}s")
        return e

    def settle(self, groups: list[EncodeGroup], answered: bool) -> None:
        """An attempt's encodes at its end: left to end on their own when the LM ``answered`` (it has
        its embeddings; cancelling would abort the encode in the encoder's engine), else cancelled (the
        encoder frees their outputs). Every failure is retrieved: after the answer it is moot."""
        for g in groups:
            if g.task is not None and not g.task.done():
                if answered:
                    self._drain(g.task)
                else:
                    g.task.cancel()
            if g.task is not None and g.task.done() and not g.task.cancelled():
                g.task.exception()
            if g.metadata.done() and not g.metadata.cancelled():
                g.metadata.exception()

    def _drain(self, task: asyncio.Task) -> None:
        """Lets an encode stream end on its own (within its deadline); close() cancels it."""
        self._draining.add(task)

        def done(t: asyncio.Task) -> None:
            self._draining.discard(t)
            if not t.cancelled():
                t.exception()  # retrieved: the request is answered

        task.add_done_callback(done)

    def draining(self) -> int:
        return len(self._draining)

    async def close(self) -> None:
        for task in self._draining:
            task.cancel()
        await asyncio.gather(*self._draining, return_exceptions=True)
