"""Runs one request across encoders and an LM, with failover.

One attempt: each image goes to an encoder (cache affinity, see
``routing``); in ``overlap`` dispatch ``Generate`` goes to the least-loaded LM
as soon as every encoder has streamed its items' metadata, so the LM tokenizes
and queues while the encoders still run (``sequential`` waits for "encoded").
Text-only requests go straight to an LM.

Failover happens only before the first token reaches the caller: an encoder
that fails or times out, or an LM that reports it could not get an item from
its encoder (the ``epd-fault: encoder`` trailer), costs a re-encode on another
encoder; an LM that fails costs a retry on another LM. An instance that
refuses the gateway (UNAUTHENTICATED, PERMISSION_DENIED: its token, certificate
or allow-list differs from its peers') is at fault as well: it is ejected and
re-verified, and the request retried elsewhere. Bad input and incompatible
peers are never retried. After the first token, a failure ends the stream with
the error. With no healthy encoder left, the LM encodes the items itself
(``local_encode_fallback``), which is plain vLLM's behaviour.

Peers may start in any order: the pools admit an instance once it passes its
health check (which needs no credentials) and its ``GetInfo`` (which does)
answers, so an instance that would refuse every call is never admitted; an LM's
``GetInfo`` must also name the served model (the first LM admitted teaches the
model unless ``--model-name`` is set). Until an LM is admitted, every request
fails at once with UNAVAILABLE and ``lm_wait_reason()``'s message.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import grpc
from prometheus_client import Counter

from epd.encoder.v1 import encoder_pb2, encoder_pb2_grpc
from epd.lm.v1 import lm_pb2, lm_pb2_grpc
from peerauth import SecurityConfig
from services.common.errors import FAULT_ENDPOINT_KEY, FAULT_KEY
from services.common.protocol import encoder_protocol_problem
from services.gateway.admission import NO_QUOTA, Admission, Ticket
from services.gateway.config import GatewayConfig
from services.gateway.instances import Instance, InstancePool
from services.gateway.routing import LeastOutstanding, pick_decode, pick_encoder

logger = logging.getLogger(__name__)

RETRIES = Counter("epd_gateway_retries_total", "Attempts retried before the first token, by the role blamed",
                  ["role", "code"])
LOCAL_FALLBACK = Counter("epd_gateway_local_encode_fallback_total",
                         "Requests whose items the LM encoded itself because no encoder was healthy")
PLACEMENT = Counter("epd_gateway_placement_total", "Where image requests were encoded, and why",
                    ["choice", "reason"])

# Codes that say the request itself is wrong (or the pair incompatible): retrying cannot help.
MAX_PENDING_RELEASES = 1024
"""RELEASE calls in flight at most (``Orchestrator._release_handoff``); past that, leases free the blocks."""
RELEASE_TIMEOUT_S = 10.0

_FINAL = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.NOT_FOUND,
          grpc.StatusCode.OUT_OF_RANGE, grpc.StatusCode.UNIMPLEMENTED}
# Codes that say one instance refuses the gateway (a token or certificate that differs, an LM whose encoder
# allow-list differs): that instance's fault, not the request's. It is ejected and re-verified (its GetInfo
# needs the credentials too); the request is retried on another instance.
_REFUSED = {grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED}
# Codes that say an instance may be gone: it is health-checked again at once.
_GONE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED,
         grpc.StatusCode.UNKNOWN}


@dataclass
class Media:
    data: bytes
    identifier: str
    modality: str = "image"


@dataclass
class Timings:
    """Per-request stage times in ms from ``start`` (the request's arrival), and
    what served it. Filled by the orchestrator; read by metrics and responses."""

    start: float = field(default_factory=time.perf_counter)
    queue_ms: float = 0.0
    metadata_ms: float = 0.0
    encode_ms: float = 0.0
    transfer_ms: float = 0.0
    lm_queue_ms: float = 0.0
    ttft_ms: float = 0.0
    tpot_ms: float = 0.0
    total_ms: float = 0.0
    retries: int = 0
    placement: str = ""  # "encoder" or "local" (the LM encoded the images), for image requests
    placement_reason: str = ""
    transports: list[str] = field(default_factory=list)
    encoders: list[str] = field(default_factory=list)
    lm: str = ""
    prefill_ms: float = 0.0
    """E -> P -> D: the PREFILL call, start to the prefill LM's hand-off."""
    prefill_lm: str = ""
    """E -> P -> D: the prefill LM (``lm`` is then the decode LM)."""

    def as_dict(self) -> dict[str, float]:
        return {k: round(v, 3) for k, v in self.__dict__.items() if k.endswith("_ms")}

    def since_start_ms(self) -> float:
        return (time.perf_counter() - self.start) * 1e3


def rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


def _call_failed(call: str, e: grpc.aio.AioRpcError) -> str:
    """Why an admission call failed, for /health's ``out`` and the logs."""
    if e.code() in _REFUSED:
        return (f"{call} failed: {e.code().name} (it refuses this gateway's credentials; check that "
                f"--auth-token-file and the TLS files match its own)")
    return f"{call} failed: {e.code().name}"


class _Failure(Exception):
    """One attempt failed at ``role`` (instances ``blame``)."""

    def __init__(self, error: grpc.aio.AioRpcError, role: str, blame: list[Instance], retryable: bool = True,
                 reverify: bool = False) -> None:
        super().__init__(error.details())
        self.error, self.role, self.blame = error, role, blame
        self.reverify = reverify
        """``blame`` refused a call by what the gateway knows of it (an LM's role, ``epd-fault: role``): it is
        verified again before it is routed to, and the request retried elsewhere whatever the code."""
        self.retryable = retryable and (reverify or error.code() not in _FINAL)


@dataclass(eq=False)
class _EncodeGroup:
    """One Encode call: the items of a request that go to one encoder."""

    inst: Instance
    indices: list[int]
    metadata: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    task: asyncio.Task | None = None

    def failure(self) -> _Failure | None:
        t = self.task
        if t is None or not t.done() or t.cancelled():
            return None
        e = t.exception()
        return e if isinstance(e, _Failure) else None


LM_ROLES = ("", "both", "prefill", "decode")
"""``LMInfo.role`` values this gateway knows ("": an LM older than roles, which is "both")."""


def _decode_request(req: lm_pb2.GenerateRequest, params: bytes) -> lm_pb2.GenerateRequest:
    """The DECODE call of an E -> P -> D request: the same request (the decode LM renders the same
    prompt), the prefill LM's kv_transfer_params, and each item under the decode LM's own claim (the
    encoder's second one: it reads an item only if its recompute of the prompt's last token needs it)."""
    d_req = lm_pb2.GenerateRequest()
    d_req.CopyFrom(req)
    d_req.kv.phase = lm_pb2.KVHandoff.DECODE
    d_req.kv.params = params
    for item in d_req.items:
        if item.HasField("source") and item.source.extra_claims:
            item.source.claim = item.source.extra_claims[0]
            del item.source.extra_claims[:]
    return d_req


class Orchestrator:
    """Owns the instance pools (their health loops start in ``start``) and runs requests."""

    def __init__(self, cfg: GatewayConfig, security: SecurityConfig | None = None, quota=None) -> None:
        """``quota``: a tenant's quotas (``Tenants.quota``), for admission; None: no tenant has any."""
        self.cfg = cfg
        pool = dict(health_interval_s=cfg.health_interval_s, dns_refresh_s=cfg.dns_refresh_s,
                    security=security or SecurityConfig())
        self.encoders = (InstancePool("encoder", cfg.encoder_list, encoder_pb2_grpc.EncoderServiceStub,
                                      verify=self._verify_encoder, **pool)
                         if cfg.encoder_list else None)
        self.lms = InstancePool("lm", cfg.lm_list, lm_pb2_grpc.LMServiceStub, verify=self._verify_lm, **pool)
        self.model: str | None = cfg.model_name or None
        """The served model name: ``--model-name``, else learned from the first LM admitted; None until then."""
        self._lm_policy = LeastOutstanding()
        self._draining: set[asyncio.Task] = set()  # encode streams of answered requests, ending on their own
        self._releasing: set[asyncio.Task] = set()  # RELEASE calls for hand-offs no decode LM took
        self.admission = Admission(
            cfg.lm_max_outstanding, cfg.encoder_max_outstanding if self.encoders is not None else 0,
            cfg.admission_queue, cfg.admission_wait_s, healthy_lms=self.generating_lms,
            healthy_encoders=lambda: len(self.encoders.healthy(set())) if self.encoders is not None else 0,
            quota=quota or (lambda tenant: NO_QUOTA))

    def generating_lms(self) -> int:
        """Healthy LMs that hold a request while it generates, for admission: "both" and decode LMs. A
        prefill LM holds a request for its prompt only; with no other LM healthy, prefill LMs serve whole
        requests and count."""
        healthy = self.lms.healthy(set())
        return sum(i.lm_role != "prefill" for i in healthy) or len(healthy)

    async def start(self) -> None:
        await asyncio.gather(*(p.start() for p in (self.encoders, self.lms) if p is not None))

    async def close(self) -> None:
        for task in [*self._draining, *self._releasing]:
            task.cancel()
        await asyncio.gather(*self._draining, *self._releasing, return_exceptions=True)
        await asyncio.gather(*(p.close() for p in (self.encoders, self.lms) if p is not None))

    async def _verify_lm(self, inst: Instance) -> str | None:
        """The LM pool's admission check (``InstancePool.verify``), for an LM that passed its health
        check: asks its model. The first LM admitted sets ``self.model`` when ``--model-name`` is not
        set; every LM must then serve that model. With ``--model-name`` set, an LM agrees when its model
        is that name or a path ending in it. Returns why ``inst`` may not be admitted, or None."""
        try:
            info = await inst.stub.GetInfo(lm_pb2.GetInfoRequest(), timeout=max(1.0, self.cfg.health_interval_s))
        except grpc.aio.AioRpcError as e:
            return _call_failed("GetInfo", e)
        model = info.model
        if info.role not in LM_ROLES:
            return f"has role {info.role!r}, which this gateway does not know (an LM of a newer epd-serve?)"
        inst.lm_role = info.role or "both"
        if self.cfg.model_name:
            if self.cfg.model_name in (model, model.rstrip("/").rsplit("/", 1)[-1]):
                return None
            return f"serves model {model!r}, not {self.cfg.model_name!r} (--model-name)"
        if self.model is None:
            self.model = model
            logger.info("serving model %s (learned from lm %s)", model, inst.address)
        elif model != self.model:
            return f"serves model {model!r}, not {self.model!r} (the model of the first LM admitted)"
        return None

    async def _verify_encoder(self, inst: Instance) -> str | None:
        """The encoder pool's admission check (``InstancePool.verify``), for an encoder that passed its
        health check: its ``GetInfo`` must answer, with the item layout this gateway reads (an encoder of
        another epd-serve version would send metadata this gateway misreads). Health checks take no token, so this is what keeps an
        encoder that would refuse every Encode (another token, another CA) out. Returns why ``inst`` may
        not be admitted, or None."""
        try:
            info = await inst.stub.GetInfo(encoder_pb2.GetInfoRequest(), timeout=max(1.0, self.cfg.health_interval_s))
        except grpc.aio.AioRpcError as e:
            return _call_failed("GetInfo", e)
        return encoder_protocol_problem(info.protocol)

    def lm_wait_reason(self) -> str | None:
        """Why no request can be served yet: no LM was ever admitted (the message names every LM and
        what it waits for). None once one was, even while every LM is ejected (those are still tried)."""
        insts = list(self.lms.instances.values())
        if any(i.healthy for i in insts) or self.lms.ejected():
            return None
        waiting = "; ".join(f"{i.address}: {i.reason}" for i in insts) or "no LM address resolved"
        return f"no LM is ready yet ({waiting})"

    def health(self) -> dict[str, dict[str, bool]]:
        pools = {"lms": self.lms, "encoders": self.encoders}
        return {k: {a: i.healthy for a, i in p.instances.items()} for k, p in pools.items() if p is not None}

    def not_admitted(self) -> dict[str, dict[str, str]]:
        """Why each instance that is not admitted is out ("health check failed: UNAVAILABLE", "serves
        model ..."), per pool as in ``health()``."""
        pools = {"lms": self.lms, "encoders": self.encoders}
        return {k: {a: f"{i.state.value}: {i.reason}" for a, i in p.instances.items() if not i.healthy}
                for k, p in pools.items() if p is not None}

    def encodes_remotely(self, n_media: int) -> bool:
        """Whether a request with ``n_media`` images may encode on an encoder (for admission)."""
        return bool(n_media) and self.encoders is not None and self.cfg.placement != "local"

    async def generate(self, req: lm_pb2.GenerateRequest, media: list[Media], timings: Timings,
                       prepare: Callable[[lm_pb2.GenerateRequest], None] | None = None,
                       ticket: Ticket | None = None, lm: str | None = None,
                       disaggregate: bool = True) -> AsyncIterator[lm_pb2.GenerateResponse]:
        """Yields the LM's responses. Raises grpc.aio.AioRpcError (from either
        service, or made here) once retries are exhausted or not allowed.
        ``prepare(req)`` runs before each LM call, once the attempt's items have
        their sources (the OpenAI routes write the LM's body there). ``ticket``:
        the request's admission (its encoder slot is given back when the
        images are encoded on the LM). ``lm``: the LM that must answer (it holds
        state the request refers to, a stored response); no other is tried. ``disaggregate``: the
        request may go E -> P -> D (a generating route; not tokenize, say)."""
        deadline = time.monotonic() + self.cfg.request_timeout_s
        excluded = {"encoder": set(), "lm": set()}
        base_id = req.request_id
        try:
            why = self.lm_wait_reason()
            if why is not None:  # fail before any encode: no LM could take the request
                raise rpc_error(grpc.StatusCode.UNAVAILABLE, why)
            for attempt in range(1, self.cfg.max_attempts + 1):
                if attempt > 1:  # a fresh id: the engines may still be dropping the failed one
                    req.request_id = f"{base_id}-retry{attempt - 1}"
                sent = False
                try:
                    async with contextlib.aclosing(self._attempt(req, media, timings, deadline, excluded,
                                                                 prepare, ticket, lm, disaggregate)) as gen:
                        async for resp in gen:
                            sent = True
                            yield resp
                    return
                except _Failure as f:
                    last = attempt == self.cfg.max_attempts or time.monotonic() >= deadline
                    if sent or not f.retryable or last:
                        if f.reverify:  # verified again even when this request cannot be retried
                            self._recheck(f)
                        raise f.error from None
                    excluded[f.role].update(i.address for i in f.blame)
                    timings.retries += 1
                    RETRIES.labels(f.role, f.error.code().name).inc()
                    logger.warning("request %s: attempt %d failed at %s %s (%s: %s); retrying elsewhere",
                                   base_id, attempt, f.role, ",".join(i.address for i in f.blame),
                                   f.error.code().name, f.error.details())
                    self._recheck(f)
        finally:
            req.request_id = base_id  # callers log and answer with the id the client knows
            timings.total_ms = timings.since_start_ms()

    def _recheck(self, f: _Failure) -> None:
        """An instance that failed a call is health-checked at once (in the
        background: this request already excludes it), so a dead one is
        ejected for every request, not just excluded for this one. One that
        refused the gateway (its credentials, or a phase its role no longer
        takes) is ejected first, so the check verifies it again (``GetInfo``):
        refused if it still rejects the credentials, else re-admitted at once
        (with the role it now has)."""
        pool = self.encoders if f.role == "encoder" else self.lms
        code = f.error.code()
        if pool is None or not (f.reverify or code in _GONE | _REFUSED):
            return
        if f.reverify or code in _REFUSED:
            for inst in f.blame:
                pool.eject(inst, f"a call was refused: {code.name}" + (
                    f" (a hand-off its role no longer takes; it was {inst.lm_role})" if f.reverify else ""))
        pool.recheck(f.blame)

    def _remaining(self, deadline: float) -> float:
        return max(0.001, deadline - time.monotonic())

    def _pick_lms(self, excluded: set[str], disaggregate: bool = True) -> tuple[Instance | None, Instance | None]:
        """The LM(s) for one attempt: ``(lm, None)``, or ``(prefill, decode)`` for E -> P -> D. LMs of
        role "both" and prefill/decode pairs are one pool: a pair is used when a healthy prefill and a
        healthy decode LM exist and its decode LM is no busier than the least busy "both" LM; the decode LM
        is one on the prefill LM's host where it can be (``routing.pick_decode``). With only one half of a
        pair left, that LM serves whole requests itself (a prefill or decode engine can)."""
        healthy = self.lms.healthy(excluded)
        if not healthy:  # all ejected (a health blip on a busy host): try the ejected ones rather than fail
            healthy = self.lms.ejected(excluded)
        by_role: dict[str, list[Instance]] = {"both": [], "prefill": [], "decode": []}
        for inst in healthy:
            by_role[inst.lm_role].append(inst)
        if disaggregate and by_role["prefill"] and by_role["decode"]:
            both = self._lm_policy.pick(by_role["both"])
            if both is None or min(d.outstanding for d in by_role["decode"]) <= both.outstanding:
                p = self._lm_policy.pick(by_role["prefill"])
                return p, pick_decode(p, by_role["decode"], self._lm_policy)
            return both, None
        return self._lm_policy.pick(healthy), None

    async def _attempt(self, req, media, timings: Timings, deadline: float, excluded: dict[str, set[str]],
                       prepare=None, ticket: Ticket | None = None, pinned: str | None = None,
                       disaggregate: bool = True):
        for item in req.items:
            item.ClearField("source")
        req.ClearField("kv")
        timings.encoders, timings.prefill_lm, timings.prefill_ms = [], "", 0.0  # this attempt's
        handoff: dict[str, bytes] = {}  # the prefill LM's params until the decode LM answers
        decode: Instance | None = None
        groups: list[_EncodeGroup] = []
        answered = False
        # Queued until the first attempt dispatches (planning below does no I/O).
        timings.queue_ms = timings.queue_ms or timings.since_start_ms()
        try:
            # All ejected (a health blip on a busy host): try the ejected ones rather than fail outright.
            # Never one that was not admitted yet: its model is unknown.
            if pinned is not None:
                lm = next((i for i in self.lms.healthy(excluded["lm"]) + self.lms.ejected(excluded["lm"])
                           if i.address == pinned), None)
                if lm is None:
                    raise _Failure(rpc_error(grpc.StatusCode.UNAVAILABLE, f"the LM that holds this request's state "
                                                                          f"({pinned}) is not available"),
                                   "lm", [], retryable=False)
                decode = None
            else:
                lm, decode = self._pick_lms(excluded["lm"], disaggregate)
            if lm is None:
                why = self.lm_wait_reason() or "no healthy LM instance"
                raise _Failure(rpc_error(grpc.StatusCode.UNAVAILABLE, why), "lm", [], retryable=False)
            if media:
                timings.placement, timings.placement_reason = self._placement(excluded)
                if timings.placement == "encoder":
                    groups = self._plan(media, excluded["encoder"], req.request_id)
                    if groups:
                        # E -> P -> D: the decode LM may need an item too (its recompute of the prompt's
                        # last token falls inside it): a second claim on each copy, the decode LM's.
                        await self._start_encodes(req, media, groups, timings, deadline,
                                                  readers=2 if decode is not None else 1)
                    else:
                        timings.placement, timings.placement_reason = "local", "no healthy encoder"
                PLACEMENT.labels(timings.placement, timings.placement_reason).inc()
                if timings.placement == "local" and ticket is not None:
                    ticket.drop_encoder()
            timings.lm = lm.address
            if prepare is not None:
                prepare(req)
            prefill = None
            if decode is not None:
                handed = await self._prefill(lm, req, groups, timings, deadline, handoff)
                if isinstance(handed, list):  # the prefill LM refused the request: its answer is the answer
                    # Not `answered`: no LM will read the encodes' copies, so they are cancelled (the encoder
                    # frees them) rather than left to their leases.
                    for resp in handed:
                        yield resp
                    return
                prefill, lm, req = lm, decode, _decode_request(req, handed)
                timings.prefill_lm, timings.lm = timings.lm, lm.address
            # aclosing: a caller that stops early (client gone) cancels the LM call now,
            # not whenever the garbage collector finalizes the generator.
            async with contextlib.aclosing(self._generate(lm, req, groups, timings, deadline,
                                                          prefill=prefill)) as lm_stream:
                try:
                    async for resp in lm_stream:
                        handoff.clear()  # the decode LM answered: the blocks are its to settle
                        yield resp
                except _Failure as f:
                    if f.reverify and decode is not None:
                        # The decode LM is one no longer (it refuses RELEASE too): another one sends it.
                        decode = next((i for i in self.lms.healthy({decode.address}) if i.lm_role == "decode"),
                                      None)
                    raise
            answered = True
        finally:
            if handoff and decode is not None:
                # Handed over and never answered by the decode LM (the client went away between the calls,
                # the call failed before reaching it): the prefill LM would pin the blocks to its lease.
                self._release_handoff(decode, req.request_id, handoff["params"])
            for g in groups:
                if g.task is not None and not g.task.done():
                    if answered:
                        # The LM has its embeddings: the encode has done its work and is
                        # about to end; cancelling would abort it in the encoder's engine.
                        self._drain(g.task)
                    else:
                        g.task.cancel()
                if g.task is not None and g.task.done() and not g.task.cancelled():
                    g.task.exception()  # retrieved: a failure after the LM finished is moot
                if g.metadata.done() and not g.metadata.cancelled():
                    g.metadata.exception()

    def _release_handoff(self, decode: Instance, rid: str, params: bytes) -> None:
        """Asks ``decode`` (a RELEASE call, in the background, bounded) to tell the prefill LM named in
        ``params`` to let the prompt's blocks go. Best effort: where it cannot (too many pending, the decode
        LM gone), the prefill LM's lease (``--kv-lease-s``) frees them."""
        if len(self._releasing) >= MAX_PENDING_RELEASES:
            logger.warning("request %s: %d KV releases pending; the prefill LM's lease frees its blocks",
                           rid, len(self._releasing))
            return
        req = lm_pb2.GenerateRequest(request_id=rid)
        req.kv.phase, req.kv.params = lm_pb2.KVHandoff.RELEASE, params

        async def release() -> None:
            try:
                async for _ in decode.stub.Generate(req, timeout=RELEASE_TIMEOUT_S):
                    pass
            except grpc.aio.AioRpcError as e:
                logger.info("request %s: decode LM %s could not release the prefill LM's blocks (%s: %s); "
                            "its lease frees them", rid, decode.address, e.code().name, e.details())

        task = asyncio.get_running_loop().create_task(release())
        self._releasing.add(task)
        task.add_done_callback(self._releasing.discard)

    def _drain(self, task: asyncio.Task) -> None:
        """Lets an encode stream end on its own (within its deadline); close() cancels it."""
        self._draining.add(task)

        def done(t: asyncio.Task) -> None:
            self._draining.discard(t)
            if not t.cancelled():
                t.exception()  # retrieved: the request is answered

        task.add_done_callback(done)

    def _placement(self, excluded: dict[str, set[str]]) -> tuple[str, str]:
        """Where this attempt's images are encoded ("encoder" or "local": the LM encodes them
        itself), and why (a short, fixed reason: the metric's label). ``--placement auto``
        encodes on the LM only when that stalls no one: an LM has no request in flight (no decode
        stream to pause) while every healthy encoder is busy (the encode would queue)."""
        if self.encoders is None:
            return "local", "no encoders"
        if self.cfg.placement != "auto":
            return self.cfg.placement, "configured"
        encoders = self.encoders.healthy(excluded["encoder"])
        if not encoders:
            return "encoder", "no healthy encoder"  # _plan decides: local fallback or 503
        lms = self.lms.healthy(excluded["lm"])
        if lms and min(i.outstanding for i in lms) == 0 \
                and min(i.outstanding for i in encoders) >= max(1, self.cfg.placement_busy_encodes):
            return "local", "lm idle, encoders busy"
        return "encoder", "auto"

    def _plan(self, media: list[Media], excluded: set[str], rid: str) -> list[_EncodeGroup]:
        """Items grouped by the encoder each one maps to and by modality (an Encode call
        carries one modality); none when no encoder is healthy and the LM may encode itself."""
        by_inst: dict[tuple[Instance, str], list[int]] = {}
        candidates = self.encoders.healthy(excluded)
        for i, m in enumerate(media):
            inst = pick_encoder(m.identifier, candidates, self.cfg.affinity_spill)
            if inst is None:
                if not self.cfg.local_encode_fallback:
                    out = "; ".join(f"{i.address}: " + ("failed this request" if i.healthy
                                                         else f"{i.state.value}: {i.reason}")
                                    for i in self.encoders.instances.values() if i not in candidates)
                    raise _Failure(rpc_error(grpc.StatusCode.UNAVAILABLE, "no healthy encoder instance"
                                             + (f" ({out})" if out else "")), "encoder", [], retryable=False)
                LOCAL_FALLBACK.inc()
                logger.warning("request %s: no healthy encoder; the LM encodes its %d item(s) itself",
                               rid, len(media))
                return []
            by_inst.setdefault((inst, m.modality), []).append(i)
        return [_EncodeGroup(inst, idx) for (inst, _), idx in by_inst.items()]

    async def _start_encodes(self, req, media, groups: list[_EncodeGroup], timings: Timings,
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

    async def _encode(self, g: _EncodeGroup, req, media, timings: Timings, enc_deadline: float,
                      readers: int = 1) -> None:
        """One Encode stream: fills sources from the metadata, then drains the
        "encoded" events. Any failure becomes a _Failure blaming this encoder."""
        items = [encoder_pb2.MediaItem(modality=media[i].modality, data=media[i].data,
                                       identifier=media[i].identifier) for i in g.indices]
        with g.inst.track():
            call = g.inst.stub.Encode(encoder_pb2.EncodeRequest(request_id=req.request_id, items=items,
                                                                readers=readers if readers > 1 else 0,
                                                                namespace=req.namespace),
                                      timeout=self._remaining(enc_deadline))
            seen = encoded = 0
            try:
                async for ev in call:
                    if ev.WhichOneof("event") == "metadata":
                        md = ev.metadata
                        item = req.items[g.indices[md.index]]
                        item.identifier = md.identifier
                        item.source.CopyFrom(md.source)  # the encoder's descriptor, as it came
                        seen += 1
                        if seen == len(items):
                            g.metadata.set_result(None)
                    else:
                        encoded += 1
                        timings.encode_ms = max(timings.encode_ms, ev.encoded.encode_ms)
                if encoded < len(items):
                    raise rpc_error(grpc.StatusCode.INTERNAL, f"encoder {g.inst.address} ended the stream after "
                                                              f"{seen} metadata and {encoded} encoded events "
                                                              f"for {len(items)} item(s)")
            except Exception as e:
                if not isinstance(e, grpc.aio.AioRpcError):
                    logger.exception("request %s: encoder %s stream failed", req.request_id, g.inst.address)
                    e = rpc_error(grpc.StatusCode.INTERNAL, f"encoder {g.inst.address}: {type(e).__name__} "
                                                            "(the gateway's log has the traceback)")
                elif e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                    e = rpc_error(e.code(), f"encoder {g.inst.address} did not encode within "
                                            f"{self.cfg.encode_timeout_s:g}s")
                failure = _Failure(e, "encoder", [g.inst])
                if not g.metadata.done():
                    g.metadata.set_exception(failure)
                raise failure from None
            finally:
                call.cancel()

    async def _generate(self, lm: Instance, req, groups: list[_EncodeGroup], timings: Timings, deadline: float,
                        final: bool = True, prefill: Instance | None = None):
        """One LM call's responses. ``final``: its answer goes to the client (a PREFILL call's does not:
        its facts are not the request's). ``prefill``: a DECODE call's prefill LM, blamed when the decode
        LM could not load the KV from it (``epd-fault: prefill``)."""
        first_at = 0.0
        stopped: BaseException | None = None  # the encode failure that stopped this call
        with lm.track():
            call_ms = timings.since_start_ms()
            call = lm.stub.Generate(req, timeout=self._remaining(deadline))

            def on_encode_done(task: asyncio.Task) -> None:
                # An encode that fails after its metadata leaves the LM waiting for an
                # embedding that will never come: stop it, unless tokens already flow.
                nonlocal stopped
                if not first_at and stopped is None and not task.cancelled() and task.exception() is not None:
                    stopped = task.exception()
                    call.cancel()

            for g in groups:
                g.task.add_done_callback(on_encode_done)
            try:
                async for resp in call:
                    # The LM's first message comes with the first token (or is the whole answer):
                    # from then on the encodes are moot and no failure is retried.
                    first_at = first_at or time.perf_counter()
                    if final and resp.HasField("timings"):  # the last message: the request's facts
                        timings.ttft_ms = call_ms + resp.timings.ttft_ms
                        timings.tpot_ms = resp.timings.tpot_ms
                        timings.transfer_ms = resp.timings.transfer_ms
                        timings.lm_queue_ms = resp.timings.lm_queue_ms
                        timings.transports = list(resp.transports)
                    yield resp
            except asyncio.CancelledError:
                # Only our own cancel (an encode failed) becomes a retryable failure;
                # the caller's cancellation (client gone) stays a cancellation.
                if isinstance(stopped, _Failure):
                    raise stopped from None
                raise
            except grpc.aio.AioRpcError as e:
                trailers = list(e.trailing_metadata() or ())
                if (FAULT_KEY, "encoder") in trailers:
                    raise _Failure(e, "encoder", self._blame(groups, req, trailers)) from None
                if (FAULT_KEY, "prefill") in trailers and prefill is not None:
                    raise _Failure(e, "lm", [prefill]) from None
                if ((FAULT_KEY, "role") in trailers and req.HasField("kv")
                        and e.code() == grpc.StatusCode.FAILED_PRECONDITION):  # restarted with another role
                    raise _Failure(e, "lm", [lm], reverify=True) from None
                raise _Failure(e, "lm", [lm]) from None
            finally:
                call.cancel()

    async def _prefill(self, lm: Instance, req, groups: list[_EncodeGroup], timings: Timings,
                       deadline: float, handoff: dict[str, bytes]) -> bytes | list[lm_pb2.GenerateResponse]:
        """The PREFILL call of an E -> P -> D request: the prefill LM computes the prompt's KV and keeps its
        blocks for a decode LM. Returns its kv_transfer_params, or, when it refused the request (vLLM's
        validation: the same answer the decode LM would give), its whole answer for the client.
        ``handoff["params"]``: the params as soon as they arrive (a cancel after that releases them)."""
        p_req = lm_pb2.GenerateRequest()
        p_req.CopyFrom(req)
        p_req.kv.phase = lm_pb2.KVHandoff.PREFILL
        answer: list[lm_pb2.GenerateResponse] = []
        started = time.perf_counter()
        async with contextlib.aclosing(self._generate(lm, p_req, groups, timings, deadline, final=False)) as stream:
            async for resp in stream:
                if resp.kv_transfer_params:
                    handoff["params"] = resp.kv_transfer_params
                answer.append(resp)
        timings.prefill_ms = (time.perf_counter() - started) * 1e3
        status = answer[0].http_status if answer else 0
        if status != 200:
            return answer
        params = answer[-1].kv_transfer_params
        if not params:
            raise _Failure(rpc_error(grpc.StatusCode.INTERNAL, f"prefill LM {lm.address} handed over no KV "
                                                               "(no kv_transfer_params)"), "lm", [lm])
        return params

    @staticmethod
    def _blame(groups: list[_EncodeGroup], req, trailers: list[tuple[str, str]]) -> list[Instance]:
        """The encoders behind an LM's ``epd-fault: encoder``: those whose encode
        failed, else those whose transfer endpoint the LM named. None when it
        cannot tell: the retry then re-encodes on the same encoders rather than
        excluding healthy ones."""
        failed = [g.inst for g in groups if g.failure() is not None]
        if failed:
            return failed
        endpoints = {v for k, v in trailers if k == FAULT_ENDPOINT_KEY}
        return [g.inst for g in groups if any(req.items[i].source.transfer_endpoint in endpoints
                                               for i in g.indices)]
