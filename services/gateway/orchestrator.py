"""Runs one request across an encoder and an LM.

Overlapped dispatch: ``Generate`` goes to the LM as soon as ``Encode`` has
streamed every item's metadata, so the LM tokenizes and queues while the
encoder still runs; the LM's connector then waits for the embeddings. Text-only
requests go straight to the LM.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc

from epd.encoder.v1 import encoder_pb2, encoder_pb2_grpc
from epd.lm.v1 import lm_pb2, lm_pb2_grpc
from services.common.grpc_server import GRPC_OPTIONS

logger = logging.getLogger(__name__)


@dataclass
class Media:
    data: bytes
    identifier: str
    modality: str = "image"


@dataclass
class Timings:
    start: float = field(default_factory=time.perf_counter)
    metadata_ms: float = 0.0
    encode_ms: float = 0.0
    transfer_ms: float = 0.0
    ttft_ms: float = 0.0
    total_ms: float = 0.0

    def as_dict(self) -> dict[str, float]:
        return {k: round(v, 3) for k, v in self.__dict__.items() if k != "start"}


class Orchestrator:
    def __init__(self, encoders: list[str], lms: list[str], timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._enc = [encoder_pb2_grpc.EncoderServiceStub(grpc.aio.insecure_channel(a, options=GRPC_OPTIONS))
                     for a in encoders]
        self._lm = [lm_pb2_grpc.LMServiceStub(grpc.aio.insecure_channel(a, options=GRPC_OPTIONS)) for a in lms]
        self._enc_rr = itertools.cycle(range(len(self._enc))) if self._enc else None
        self._lm_rr = itertools.cycle(range(len(self._lm)))

    async def model_name(self) -> str:
        info = await self._lm[0].GetInfo(lm_pb2.GetInfoRequest(), timeout=10)
        return info.model

    async def generate(self, req: lm_pb2.GenerateRequest, media: list[Media],
                       timings: Timings) -> AsyncIterator[lm_pb2.GenerateResponse]:
        """Yields the LM's responses. Raises grpc.aio.AioRpcError from either service."""
        encode_tail = None
        if media and self._enc_rr is not None:
            encode_tail = await self._encode(req, media, timings)
        # Without encoders (colocated mode) the items carry no source and the
        # LM's vLLM encodes them itself, exactly as plain vLLM would.
        lm = self._lm[next(self._lm_rr)]
        call = lm.Generate(req, timeout=self.timeout_s)
        if encode_tail is not None:
            # An encode that fails after its metadata must not leave the LM
            # waiting for an embedding that will never come.
            encode_tail.add_done_callback(lambda t: t.cancelled() or t.exception() is None or call.cancel())
        try:
            first = True
            try:
                async for resp in call:
                    if first and resp.token_ids:
                        timings.ttft_ms = (time.perf_counter() - timings.start) * 1e3
                        first = False
                    if resp.finish_reason:
                        timings.transfer_ms = resp.timings.transfer_ms
                    yield resp
            except asyncio.CancelledError:
                if encode_tail is not None and encode_tail.done() and not encode_tail.cancelled() \
                        and encode_tail.exception() is not None:
                    raise encode_tail.exception() from None
                raise
            if encode_tail is not None:
                await asyncio.wait_for(encode_tail, timeout=self.timeout_s)
        finally:
            call.cancel()
            if encode_tail is not None and not encode_tail.done():
                encode_tail.cancel()
            timings.total_ms = (time.perf_counter() - timings.start) * 1e3

    async def _encode(self, req: lm_pb2.GenerateRequest, media: list[Media], timings: Timings) -> asyncio.Task:
        """Starts Encode, fills each item's source from its metadata, and returns
        a task that drains the rest of the stream (the "encoded" events)."""
        enc = self._enc[next(self._enc_rr)]
        call = enc.Encode(encoder_pb2.EncodeRequest(
            request_id=req.request_id,
            items=[encoder_pb2.MediaItem(modality=m.modality, data=m.data, identifier=m.identifier) for m in media],
        ), timeout=self.timeout_s)
        seen = 0
        while seen < len(media):
            ev = await call.read()
            if ev is grpc.aio.EOF:
                raise grpc.aio.AioRpcError(grpc.StatusCode.INTERNAL, None, None,
                                           "encoder ended the stream before sending every item's metadata")
            if ev.WhichOneof("event") != "metadata":
                continue
            md = ev.metadata
            item = req.items[md.index]
            item.identifier = md.identifier
            item.source.CopyFrom(lm_pb2.ItemSource(
                transfer_endpoint=md.transfer_endpoint, encoder_id=md.encoder_id,
                num_embeds=md.num_embeds, embed_width=md.embed_width, dtype=md.dtype))
            seen += 1
        timings.metadata_ms = (time.perf_counter() - timings.start) * 1e3

        async def drain() -> None:
            while (ev := await call.read()) is not grpc.aio.EOF:
                if ev.WhichOneof("event") == "encoded":
                    timings.encode_ms = max(timings.encode_ms, ev.encoded.encode_ms)

        return asyncio.create_task(drain())
