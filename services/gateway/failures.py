"""What a failed call means for the request: the one place the gateway classifies a gRPC error from an
encoder or an LM (which role is at fault, which instances, whether a retry elsewhere can help) and
reads the peers' blame (``epd.lm.v1.Fault``, the ``epd-fault`` trailers).

``Failure`` is raised inside one attempt and caught by ``Orchestrator.generate``, which retries on other
instances or re-raises the gRPC error."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import grpc

from epd.lm.v1 import lm_pb2
from services.common.errors import FAULT_ENDPOINT_KEY, read_fault
from services.gateway.instances import Instance

# Codes that say the request itself is wrong (or the pair incompatible): retrying cannot help.
FINAL = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.NOT_FOUND,
         grpc.StatusCode.OUT_OF_RANGE, grpc.StatusCode.UNIMPLEMENTED}
# Codes that say one instance refuses the gateway (a token or certificate that differs, an LM whose encoder
# allow-list differs): that instance's fault, not the request's. It is ejected and re-verified (its GetInfo
# needs the credentials too); the request is retried on another instance.
REFUSED = {grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED}
# Codes that say an instance may be gone: it is health-checked again at once.
GONE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED,
        grpc.StatusCode.UNKNOWN}


def rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    """An error made by the gateway, in the form the peers' errors take."""
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


def call_failed(call: str, e: grpc.aio.AioRpcError) -> str:
    """Why an admission call failed, for /health's ``out`` and the logs."""
    if e.code() in REFUSED:
        return (f"{call} failed: {e.code().name} (it refuses this gateway's credentials; check that "
                f"--auth-token-file and the TLS files match its own)")
    return f"{call} failed: {e.code().name}"


class Failure(Exception):
    """One attempt failed at ``role`` (instances ``blame``)."""

    def __init__(self, error: grpc.aio.AioRpcError, role: str, blame: list[Instance], retryable: bool = True,
                 reverify: bool = False) -> None:
        super().__init__(error.details())
        self.error, self.role, self.blame = error, role, blame
        self.reverify = reverify
        """``blame`` refused a call by what the gateway knows of it (an LM's role, ``FAULT_ROLE``): it is
        verified again before it is routed to, and the request retried elsewhere whatever the code."""
        self.retryable = retryable and (reverify or error.code() not in FINAL)


class EncodeCall(Protocol):
    """What blame reads of one Encode call (``encoding.EncodeGroup``)."""

    inst: Instance
    indices: list[int]

    def failure(self) -> Failure | None: ...


def lm_failure(e: grpc.aio.AioRpcError, lm: Instance, req, groups: Sequence[EncodeCall],
               prefill: Instance | None = None, handoff_call: bool = False) -> Failure:
    """An LM call's error as the attempt's failure, by the LM's blame: an encoder it could not get an
    item from (re-encoded elsewhere), the prefill LM it could not load the KV from, a hand-off its role
    no longer takes (``handoff_call``: a PREFILL or DECODE call; re-verified), else the LM itself."""
    trailers = list(e.trailing_metadata() or ())
    fault = read_fault(trailers)
    if fault == lm_pb2.FAULT_ENCODER:
        return Failure(e, "encoder", blame(groups, req, trailers))
    if fault == lm_pb2.FAULT_PREFILL and prefill is not None:
        return Failure(e, "lm", [prefill])
    if fault == lm_pb2.FAULT_ROLE and handoff_call and e.code() == grpc.StatusCode.FAILED_PRECONDITION:
        return Failure(e, "lm", [lm], reverify=True)  # restarted with another role
    return Failure(e, "lm", [lm])


def blame(groups: Sequence[EncodeCall], req, trailers: list[tuple[str, str]]) -> list[Instance]:
    """The encoders behind an LM's ``FAULT_ENCODER``: those whose encode failed, else those whose
    transfer endpoint the LM named. None when it cannot tell: the retry then re-encodes on the same
    encoders rather than excluding healthy ones."""
    failed = [g.inst for g in groups if g.failure() is not None]
    if failed:
        return failed
    endpoints = {v for k, v in trailers if k == FAULT_ENDPOINT_KEY}
    return [g.inst for g in groups if any(req.items[i].source.transfer_endpoint in endpoints for i in g.indices)]
