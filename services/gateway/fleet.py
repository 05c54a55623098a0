"""The gateway's fleet: its encoders and LMs (one ``InstancePool`` per role, with their health loops),
what it takes to admit one (``GetInfo``: the served model, the LM's role, the encoder's protocol), what
/health says of them, and which of them one attempt of a request uses (``pick_encoder``, ``pick_lms``,
``placement``). Which encoder and which LM is the routing policies' choice (``services.gateway.policies``),
each picked once by name here at start; the fleet never asks which one it holds.

Owner: the ``Orchestrator`` makes one ``Fleet`` and closes it; the pools' channels, the directories and the
policy objects are the fleet's."""

from __future__ import annotations

import logging
import time

import grpc

from epd.encoder.v1 import encoder_pb2, encoder_pb2_grpc
from epd.lm.v1 import lm_pb2, lm_pb2_grpc
from epd.transfer.v1 import transfer_pb2
from peerauth import SecurityConfig
from services.common.protocol import encoder_protocol_problem
from services.fleet_memory import prefix
from services.fleet_memory.directory import Directory
from services.gateway.config import GatewayConfig
from services.gateway.failures import GONE, REFUSED, Failure, call_failed
from services.gateway.fleet_file import FleetFile
from services.gateway.instances import Instance, InstancePool
from services.gateway.lm_body import LMBody
from services.gateway.policies.base import LMRequest, request_key
from services.gateway.policies.factory import encoder_policy, lm_policy
from services.gateway.routing import LeastOutstanding, pick_decode

logger = logging.getLogger(__name__)

LM_ROLES = ("", "both", "prefill", "decode")
"""``LMInfo.role`` values this gateway knows ("": an LM older than roles, which is "both")."""


class Fleet:
    """The encoder pool (None without ``--encoders``) and the LM pool, and the served model."""

    def __init__(self, cfg: GatewayConfig, security: SecurityConfig | None = None) -> None:
        self.cfg = cfg
        pool = dict(health_interval_s=cfg.health_interval_s, dns_refresh_s=cfg.dns_refresh_s,
                    security=security or SecurityConfig())
        self.encoder_memory = Directory()
        """What each encoder's outbound store and host tier hold, by item (``services.fleet_memory``)."""
        self.encoder_policy = encoder_policy(cfg.encoder_routing, cfg, self.encoder_memory)
        """Which encoder encodes an item (``--encoder-routing``)."""
        # --fleet-file: a role the file lists takes its entries from it, then follows it (fleet_file.py).
        self.fleet_file = FleetFile(cfg.fleet_file) if cfg.fleet_file else None
        encoders, lms = (self._entries("encoder", cfg.encoder_list), self._entries("lm", cfg.lm_list))
        self.encoders = (InstancePool("encoder", encoders, encoder_pb2_grpc.EncoderServiceStub,
                                      verify=self._verify_encoder, removed=self.encoder_memory.forget,
                                      watch=self._poller(self.encoder_memory) if self.encoder_policy.watches
                                      else None, entries_source=self._source("encoder"), **pool)
                         if encoders or self._source("encoder") else None)
        self.memory = Directory()
        """What each LM's prefix cache holds, by media item (``services.fleet_memory``)."""
        self.lm_policy = lm_policy(cfg.lm_routing, cfg, self.memory)
        """Which LM answers a request (``--lm-routing``)."""
        self.lms = InstancePool("lm", lms, lm_pb2_grpc.LMServiceStub, verify=self._verify_lm,
                                watch=self._poller(self.memory) if self.lm_policy.watches else None,
                                removed=self.memory.forget, entries_source=self._source("lm"), **pool)
        self.model: str | None = cfg.model_name or None
        """The served model name: ``--model-name``, else learned from the first LM admitted; None until then."""
        self._least = LeastOutstanding()
        """The least busy pick every policy shares: of a decode LM, and of a "both" LM to weigh a pair against."""

    def _entries(self, role: str, configured: list[str]) -> list[str]:
        """``role``'s entries at start: the fleet file's where it lists the role, else the command line's."""
        listed = self.fleet_file.entries(role) if self.fleet_file is not None else None
        return configured if listed is None else listed

    def _source(self, role: str):
        """The pool's ``entries_source``: the fleet file's reader of ``role``, where the file lists it."""
        if self.fleet_file is None or not self.fleet_file.has(role):
            return None
        return lambda: self.fleet_file.entries(role)

    def pools(self) -> list[InstancePool]:
        return [p for p in (self.encoders, self.lms) if p is not None]

    # -- admission of instances ---------------------------------------------------------------------

    async def _verify_lm(self, inst: Instance) -> str | None:
        """The LM pool's admission check (``InstancePool.verify``), for an LM that passed its health
        check: asks its model. The first LM admitted sets ``self.model`` when ``--model-name`` is not
        set; every LM must then serve that model. With ``--model-name`` set, an LM agrees when its model
        is that name or a path ending in it. Returns why ``inst`` may not be admitted, or None."""
        try:
            info = await inst.stub.GetInfo(lm_pb2.GetInfoRequest(), timeout=max(1.0, self.cfg.health_interval_s))
        except grpc.aio.AioRpcError as e:
            return call_failed("GetInfo", e)
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

    def _poller(self, directory: Directory):
        async def poll(inst: Instance) -> None:
            """After each passing health check of an admitted instance: its ``Holdings`` into ``directory``
            (only what changed since the snapshot held). One that does not answer keeps its entry until it
            does, is removed, or restarts (a new epoch): the entry only steers routing."""
            epoch, generation = directory.known(inst.address)
            asked = time.monotonic()
            try:
                reply = await inst.stub.Holdings(transfer_pb2.HoldingsRequest(epoch=epoch, generation=generation),
                                                 timeout=max(1.0, self.cfg.health_interval_s))
            except grpc.aio.AioRpcError as e:
                if e.code() == grpc.StatusCode.UNIMPLEMENTED:  # older than Holdings: routed as before
                    directory.forget(inst.address)
                return
            directory.update(inst.address, reply.epoch, reply.generation,
                             list(reply.items) if reply.changed else None, asked)
        return poll

    def prefix_of(self, body: LMBody | None) -> prefix.Prefix:
        """A generating request's prefix keys (``services.fleet_memory.prefix``), where the LM policy routes
        by them; else none."""
        return self.lm_policy.prefix(body)

    def route_keys(self, items: list[str], body: LMBody | None, sent: bytes = b"") -> tuple[prefix.Prefix, str]:
        """A request's prefix keys (``prefix_of``) and routing key (``request_key``): one call, which the
        orchestrator runs on a thread for a large body (both spend its size in hashes, which release the
        GIL)."""
        keys = self.prefix_of(body)
        return keys, self.request_key(items, keys, body, sent)

    @staticmethod
    def request_key(items: list[str], keys: prefix.Prefix, body: LMBody | None, sent: bytes = b"") -> str:
        """The request's routing key (``policies.base.request_key``) from its prefix ``keys``, else the media
        it encodes (``items``) or carries (``body.media``, known by their content hashes: never their bytes),
        else its text: ``body``'s JSON, or the body bytes ``sent`` without one."""
        if body is not None:
            return request_key(items or [m.identifier for m in body.media], keys, body.body)
        return request_key(items, keys, sent or None)

    def answered(self, lm: Instance, items: list[str], key: str = "") -> None:
        """``lm`` answered a request with media ``items`` and prefix key ``key``: it holds them until its next
        snapshot says."""
        self.lm_policy.answered(lm, items, key)

    def encoded(self, encoder: Instance, items: list[str]) -> None:
        """``items`` are sent to ``encoder`` to encode: its store holds them (or will, once encoded) until its
        next snapshot says."""
        self.encoder_policy.sent(encoder, items)

    def pick_encoder(self, key: str, candidates: list[Instance]) -> Instance | None:
        """The encoder among ``candidates`` for the item whose content hash is ``key`` (``--encoder-routing``)."""
        return self.encoder_policy.pick(key, candidates)

    async def _verify_encoder(self, inst: Instance) -> str | None:
        """The encoder pool's admission check (``InstancePool.verify``), for an encoder that passed its
        health check: its ``GetInfo`` must answer, with the item layout this gateway reads (an encoder of
        another epd-serve version would send metadata this gateway misreads). Health checks take no token,
        so this is what keeps an encoder that would refuse every Encode (another token, another CA) out.
        Returns why ``inst`` may not be admitted, or None."""
        try:
            info = await inst.stub.GetInfo(encoder_pb2.GetInfoRequest(), timeout=max(1.0, self.cfg.health_interval_s))
        except grpc.aio.AioRpcError as e:
            return call_failed("GetInfo", e)
        inst.speech_windows = info.speech_windows
        return encoder_protocol_problem(info.protocol)

    def recheck(self, f: Failure) -> None:
        """An instance that failed a call is health-checked at once (in the
        background: this request already excludes it), so a dead one is
        ejected for every request, not just excluded for this one. One that
        refused the gateway (its credentials, or a phase its role no longer
        takes) is ejected first, so the check verifies it again (``GetInfo``):
        refused if it still rejects the credentials, else re-admitted at once
        (with the role it now has)."""
        pool = self.encoders if f.role == "encoder" else self.lms
        code = f.error.code()
        if pool is None or not (f.reverify or code in GONE | REFUSED):
            return
        if f.reverify or code in REFUSED:
            for inst in f.blame:
                pool.eject(inst, f"a call was refused: {code.name}" + (
                    f" (a hand-off its role no longer takes; it was {inst.lm_role})" if f.reverify else ""))
        pool.recheck(f.blame)

    # -- what /health and admission read -------------------------------------------------------------

    def generating_lms(self) -> int:
        """Healthy LMs that hold a request while it generates, for admission: "both" and decode LMs. A
        prefill LM holds a request for its prompt only; with no other LM healthy, prefill LMs serve whole
        requests and count."""
        healthy = self.lms.healthy(set())
        return sum(i.lm_role != "prefill" for i in healthy) or len(healthy)

    def healthy_encoders(self) -> int:
        return len(self.encoders.healthy(set())) if self.encoders is not None else 0

    def lm_wait_reason(self) -> str | None:
        """Why no request can be served yet: no LM was ever admitted (the message names every LM and
        what it waits for). None once one was, even while every LM is ejected (those are still tried)."""
        insts = list(self.lms.instances.values())
        if any(i.healthy for i in insts) or self.lms.ejected() or self.lms.draining():
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

    # -- which instances one attempt uses ------------------------------------------------------------

    def pinned_lm(self, address: str, excluded: set[str]) -> Instance | None:
        """The LM at ``address`` (it holds state the request refers to), healthy, ejected or draining (its
        stored responses are readable until it has left); None if it is not admitted or excluded. Never one
        that was not admitted yet: its model is unknown."""
        return next((i for i in self.lms.healthy(excluded) + self.lms.ejected(excluded)
                     + self.lms.draining(excluded) if i.address == address), None)

    def pick_lms(self, excluded: set[str], disaggregate: bool = True, items: list[str] | None = None,
                 keys: prefix.Prefix = prefix.NONE, key: str = "") -> tuple[Instance | None, Instance | None]:
        """The LM(s) for one attempt: ``(lm, None)``, or ``(prefill, decode)`` for E -> P -> D. LMs of
        role "both" and prefill/decode pairs are one pool: a pair is used when a healthy prefill and a
        healthy decode LM exist and its decode LM is no busier than the least busy "both" LM; the decode LM
        is one on the prefill LM's host where it can be (``routing.pick_decode``). With only one half of a
        pair left, that LM serves whole requests itself (a prefill or decode engine can). ``items``: the
        request's media identifiers, ``keys`` its prefix keys, ``key`` its routing key (``request_key``; from
        ``items`` and ``keys`` when not given): the LM (or prefill LM) is the LM policy's pick, and a tie
        between equally busy LMs goes by rendezvous hashing of ``key``, the same on every gateway replica."""
        items = items or []
        request = LMRequest(items, keys, key or request_key(items, keys))
        healthy = self.lms.healthy(excluded)
        if not healthy:  # all ejected (a health blip on a busy host): try the ejected ones rather than fail
            healthy = self.lms.ejected(excluded) or self.lms.draining(excluded)  # then the leaving ones
        by_role: dict[str, list[Instance]] = {"both": [], "prefill": [], "decode": []}
        for inst in healthy:
            by_role[inst.lm_role].append(inst)
        if disaggregate and by_role["prefill"] and by_role["decode"]:
            both = self._least.pick(by_role["both"], request.key)
            if both is None or min(d.outstanding for d in by_role["decode"]) <= both.outstanding:
                p = self.lm_policy.pick(by_role["prefill"], request)
                return p, pick_decode(p, by_role["decode"], self._least, request.key)
            return self.lm_policy.pick(by_role["both"], request), None
        return self.lm_policy.pick(healthy, request), None

    def placement(self, excluded: dict[str, set[str]]) -> tuple[str, str]:
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
            return "encoder", "no healthy encoder"  # encoding.plan decides: local fallback or 503
        lms = self.lms.healthy(excluded["lm"])
        if lms and min(i.outstanding for i in lms) == 0 \
                and min(i.outstanding for i in encoders) >= max(1, self.cfg.placement_busy_encodes):
            return "local", "lm idle, encoders busy"
        return "encoder", "auto"
