"""The E -> P -> D hand-off on an LM: the one owner of vLLM's ``kv_transfer_params`` here.

A prefill LM runs a request's prompt for one token and keeps its KV blocks for a decode LM; the
decode LM loads them through vLLM's NixlConnector (``kv_transfer_config``) and answers. The gateway
names the phase in the call's ``KVHandoff`` (``lm_pb2``); a DECODE or RELEASE call carries the
prefill LM's params, read once here (``Handoff.of``) and passed on as a ``Handoff``. Everything
that touches the request field vLLM reads them from is here:

- ``strip``: a client's body never names a prefill engine (every vLLM API reads the field);
- ``set_sampling``: the sampling of a hand-off call (and a client's ``vllm_xargs`` dropped);
- ``take_report``: a prefill call's output params, taken off vLLM's output for the gateway;
- ``response_fields``: them, in the call's last message;
- ``release``: a DECODE call that will not load the blocks lets the prefill LM free them.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from epd.lm.v1 import lm_pb2
from peerauth import is_loopback
from services.common.errors import BadInput, RoleMismatch
from services.lm.kv_peers import EXTRA_KEY, PeerCheck, parse_peers

if TYPE_CHECKING:
    from vllm.config import KVTransferConfig

logger = logging.getLogger(__name__)

PREFILL, DECODE, RELEASE = lm_pb2.KVHandoff.PREFILL, lm_pb2.KVHandoff.DECODE, lm_pb2.KVHandoff.RELEASE
PHASES = {PREFILL: "prefill", DECODE: "decode", RELEASE: "release"}
"""Each phase's name (the ``phase`` label of ``epd_lm_kv_handoffs_total``)."""
_ROLE = {PREFILL: "prefill", DECODE: "decode", RELEASE: "decode"}
"""The LM role that takes each phase."""

KV_TRANSFER_PARAMS = "kv_transfer_params"
"""The request field every vLLM API reads (chat, completions, Responses, Messages) that names the prefill
engine a decode engine dials: dropped from every body (``strip``); the gateway's ``KVHandoff`` is the
one source (``set_sampling``)."""

REMOTE_DECODE = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                 "remote_block_ids": None, "remote_host": None, "remote_port": None}
"""What a prefill request asks vLLM's NixlConnector for (as vLLM's own disaggregation proxies send it):
keep the prompt's blocks for a decode engine, and say where they are in the output's kv_transfer_params."""


NIXL_CONNECTOR_MODULE = "services.lm.nixl_connector"
"""Where vLLM's connector factory finds our ``NixlConnector`` (vLLM's, its handshake listener guarded)."""

PREFILL_ONLY = {"store": False, "background": False}
"""What a Responses request's prefill call sets: its one-token answer is discarded, so nothing of it is
stored (the decode LM stores the answer), and it runs within the call (the gateway splits no background
request; this makes sure)."""


@dataclass(frozen=True)
class Handoff:
    """A call's hand-off, read once from its ``KVHandoff``. ``phase``: 0 for none (the LM prefills and
    decodes); ``params``: DECODE or RELEASE, the prefill LM's params (a JSON object with
    ``do_remote_prefill``), None when absent or unreadable (``problem`` says why)."""

    phase: int = 0
    params: dict | None = None
    problem: str = ""
    given: bool = False
    """The call carried a ``KVHandoff`` (``check`` refuses one without a phase)."""

    @classmethod
    def of(cls, request: lm_pb2.GenerateRequest) -> Handoff:
        """The request's hand-off; never raises (``check`` refuses what it cannot take)."""
        if not request.HasField("kv"):
            return cls()
        kv = request.kv
        if kv.phase not in (DECODE, RELEASE):
            return cls(kv.phase, given=True)
        try:
            params = json.loads(kv.params)
        except (ValueError, UnicodeDecodeError) as e:
            return cls(kv.phase, None, f"kv.params is not JSON: {e}", given=True)
        if not isinstance(params, dict) or not params.get("do_remote_prefill"):
            return cls(kv.phase, None, f"kv.params must be a prefill LM's {KV_TRANSFER_PARAMS} (do_remote_prefill)",
                       given=True)
        return cls(kv.phase, params, given=True)

    def check(self, role: str) -> None:
        """BadInput or RoleMismatch for a hand-off this LM (of ``role``) does not take."""
        if not self.given:
            return
        want = _ROLE.get(self.phase)
        if want is None:
            raise BadInput(f"kv.phase must be PREFILL, DECODE or RELEASE, got {self.phase}")
        if role != want:
            raise RoleMismatch(f"this LM's role is {role or 'both'}: it takes no "
                               f"{lm_pb2.KVHandoff.Phase.Name(self.phase)} call")
        if self.problem:
            raise BadInput(self.problem)

    @property
    def name(self) -> str:
        return PHASES.get(self.phase, "")


def strip(body: Any) -> bool:
    """Drops ``kv_transfer_params`` from a parsed request body (a JSON object; anything else is left);
    whether it was there."""
    if isinstance(body, dict) and KV_TRANSFER_PARAMS in body:
        del body[KV_TRANSFER_PARAMS]
        return True
    return False


def set_sampling(kv: Handoff, sampling_params, extra: dict) -> None:
    """The engine call's ``extra`` (its ``extra_args``) without a client's ``kv_transfer_params`` (a
    request field of every vLLM API, or ``vllm_xargs``: they would name the prefill engine a decode LM
    dials), and a hand-off call's own. PREFILL: one sequence, one token (the prompt's KV is what this
    call is for; its tokens are discarded); DECODE: the KV comes from the prefill LM."""
    extra.pop(KV_TRANSFER_PARAMS, None)
    if kv.phase == PREFILL:
        extra[KV_TRANSFER_PARAMS] = dict(REMOTE_DECODE)
        sampling_params.n = 1
        sampling_params.max_tokens = 1
        sampling_params.min_tokens = 0
    elif kv.phase == DECODE:
        extra[KV_TRANSFER_PARAMS] = dict(kv.params or {})


def take_report(out) -> dict | None:
    """A vLLM ``RequestOutput``'s kv_transfer_params, taken off it (for the gateway: a decode LM dials
    them; never in an answer, where vLLM would copy them); None when it has none."""
    report = getattr(out, KV_TRANSFER_PARAMS)
    if report is not None:
        setattr(out, KV_TRANSFER_PARAMS, None)
    return report


def response_fields(kv: Handoff, report: dict | None) -> dict:
    """The hand-off's fields of a call's last ``GenerateResponse``: the prefill params for the gateway."""
    return {KV_TRANSFER_PARAMS: json.dumps(report).encode() if report and kv.phase else b""}


async def release(engine, rid: str, params: dict | None) -> None:
    """Tells the prefill LM named by ``params`` to let request ``rid``'s blocks go (vLLM's own hook;
    a prefill LM that already did logs the notice and ignores it). Never raises: the blocks' lease
    frees them anyway."""
    try:
        await engine.notify_kv_transfer_request_rejected(rid, params or {})
    except Exception:  # the blocks' lease frees them anyway
        logger.warning("request %s: could not tell the prefill LM to release its blocks", rid, exc_info=True)


def kv_transfer_config(cfg) -> KVTransferConfig | None:
    """A prefill or decode LM's KV connector (``cfg``: ``LMServiceConfig``): vLLM's NixlConnector (UCX:
    TCP or shared memory between CPU hosts, NVLink/RDMA between GPUs), the KV staged in host memory on a
    CPU platform, with its handshake listener guarded (``services.lm.nixl_connector``: a bad frame is
    dropped, and only the deployment's engines get an answer, ``services.lm.kv_peers``); None for role
    both. Its side channel binds ``--kv-host``:``--kv-port`` (loopback unless
    ``--insecure-kv-side-channel``: ``LMServiceConfig``): vLLM reads both from the environment in the
    engine's worker, which this process starts next."""
    if not cfg.disaggregated:
        return None
    # vLLM only here: RequestContext (services.lm.context) holds a Handoff, and its importers stay light.
    from vllm.config import KVTransferConfig
    from vllm.platforms import current_platform

    if not is_loopback(cfg.kv_host):
        logger.warning("NIXL's side channel listens on %s:%d (--insecure-kv-side-channel), checked by address "
                       "only (--kv-peers: %s): a host that reaches it from an admitted address can read this "
                       "engine's KV blocks; keep all but the deployment's LMs off that port", cfg.kv_host,
                       cfg.kv_port, cfg.kv_peers or "any")
    os.environ["VLLM_NIXL_SIDE_CHANNEL_HOST"] = cfg.kv_host
    os.environ["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(cfg.kv_port)
    side_channel = PeerCheck(peers=parse_peers(cfg.kv_peers)).to_dict()
    return KVTransferConfig(kv_connector="NixlConnector", kv_connector_module_path=NIXL_CONNECTOR_MODULE,
                            kv_role="kv_producer" if cfg.role == "prefill" else "kv_consumer",
                            kv_buffer_device="cpu" if current_platform.is_cpu() else "cuda",
                            kv_connector_extra_config={"kv_lease_duration": cfg.kv_lease_s,
                                                       EXTRA_KEY: side_channel})
