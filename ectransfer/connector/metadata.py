"""What the connector exchanges, as plain dataclasses.

- Between its scheduler and worker halves (``LoadSpec``, ``SaveSpec``,
  ``EPDConnectorMetadata``, ``EPDWorkerMetadata``): picklable, built fresh every
  engine step; no sockets, locks or tensors inside.
- With the services, through the dicts vLLM carries unchanged on its request and
  output objects (frozen, each with one ``to_dict`` and one ``from_dict``):

  ``ECTransferParams``   LM service -> consumer scheduler half, as
                         ``SamplingParams.extra_args["ec_transfer_params"]`` (vLLM
                         copies it to ``Request.ec_transfer_params``): the encoder
                         of each item. Written only by ``services.lm.frontend``
                         (a caller's own is dropped there), read by
                         ``ConsumerScheduler``.
  ``ConsumerFinished``   consumer scheduler half -> LM service, returned by
                         ``request_finished`` (``RequestOutput.ec_transfer_params``):
                         the request's error and timings.
  ``ProducerFinished``   producer scheduler half -> encoder service, the same way:
                         the request's items and vision-encoder runs.

``from_dict`` checks every key and type and raises ``ValueError`` naming what is
wrong; a reader that must not raise (a hook inside vLLM's engine step) turns that
into a failed request.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorMetadata, ECConnectorWorkerMetadata

from ectransfer import tensors


@dataclass
class LoadSpec:
    """Consumer: copy ``nbytes`` at ``offset`` of ``segment`` into vLLM's
    encoder cache. Without ``transport`` the segment is the scheduler half's
    inbound staging (where gRPC chunks, or a demoted item, landed). With it the
    item is read in place: ``segment`` is the encoder's memory that transport
    names (``ConsumerTransport.where``: a shared-memory segment, a CUDA pool
    id), ``source`` the item's serialized ``epd.transfer.v1.TensorDescriptor``,
    and the worker copies it with that transport's ``load``; the encoder holds
    it until the scheduler half acks after the load."""

    identifier: str
    shape: tuple[int, ...]
    dtype: str
    segment: str
    offset: int
    nbytes: int
    transport: str = ""
    """The in-place transport's name (``ConsumerTransport.name``); "" for staging."""
    source: bytes = b""


@dataclass
class SaveSpec:
    """Producer: copy encoder output ``identifier`` into ``nbytes`` at ``offset``
    of shared-memory ``segment`` (a slot the scheduler half reserved), or of
    the CUDA pool ``cuda_ref`` names (a serialized ``CudaIpcRef``)."""

    identifier: str
    segment: str
    offset: int
    nbytes: int
    shape: tuple[int, ...]
    dtype: str
    cuda_ref: bytes = b""


@dataclass
class EPDConnectorMetadata(ECConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)
    """Consumer: items to inject this step."""
    saves: list[SaveSpec] = field(default_factory=list)
    """Producer: slots reserved this step, one per item to save."""
    drops: list[str] = field(default_factory=list)
    """Producer: items whose slot was handed over earlier but whose every request ended
    before it was encoded (aborted): the worker forgets the slot and reports it dropped."""
    notify: str = ""
    """Producer: unix datagram address the worker reports saves to."""
    notify_key: bytes = b""
    """Producer: the key every report starts with (the socket drops datagrams without it)."""
    unmap: list[tuple[str, str]] = field(default_factory=list)
    """Consumer: (transport name, memory) of encoders whose stream closed
    (``TransferClient.take_unmapped``): the worker unmaps them with that
    transport's ``forget`` after this step's loads."""


@dataclass
class EPDWorkerMetadata(ECConnectorWorkerMetadata):
    loaded: list[str] = field(default_factory=list)
    """Consumer: items injected into vLLM's encoder cache this step."""

    def aggregate(self, other: ECConnectorWorkerMetadata) -> EPDWorkerMetadata:
        # Every TP rank injects the same items.
        assert isinstance(other, EPDWorkerMetadata)
        return EPDWorkerMetadata(sorted(set(self.loaded) | set(other.loaded)))


# -- contracts with the services (dicts vLLM carries) --------------------------


def _mapping(value: Any, what: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise ValueError(f"{what} must be a mapping, got {type(value).__name__}")
    return value


def _keys(d: Mapping[str, Any], what: str, allowed: tuple[str, ...], required: tuple[str, ...] = ()) -> None:
    unknown = sorted(str(k) for k in d if k not in allowed)
    if unknown:
        raise ValueError(f"{what}: unknown keys {unknown}; allowed: {sorted(allowed)}")
    missing = [k for k in required if k not in d]
    if missing:
        raise ValueError(f"{what}: missing keys {missing}")


def _str(value: Any, what: str, nonempty: bool = False) -> str:
    if not isinstance(value, str) or (nonempty and not value):
        raise ValueError(f"{what} must be a {'non-empty ' if nonempty else ''}string, got {value!r}")
    return value


def _int(value: Any, what: str, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{what} must be an integer >= {minimum}, got {value!r}")
    return value


def _float(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise ValueError(f"{what} must be a number >= 0, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class ItemSource:
    """Where the consumer pulls one item's embedding from, and the shape it must arrive in.
    Checked on construction (``ValueError``), however it is built."""

    endpoint: str
    """The encoder's Transfer server, ``host:port`` (the LM service checked it is allowed)."""
    embed_width: int
    """Columns of the embedding; its rows are the prompt's placeholder embeds."""
    dtype: str
    """Element type by name (``ectransfer.tensors.dtype_from_name``), e.g. ``bfloat16``."""
    claim: str = ""
    """The Encode call's claim on the copy (``ItemSource.claim``), named in Reserve, Ack and Cancel."""

    def __post_init__(self) -> None:
        _str(self.endpoint, "endpoint", nonempty=True)
        _int(self.embed_width, "embed_width", minimum=1)
        tensors.dtype_from_name(_str(self.dtype, "dtype", nonempty=True))  # ValueError listing the allowed names
        _claim(self.claim, "claim")

    def to_dict(self) -> dict[str, Any]:
        d = {"endpoint": self.endpoint, "embed_width": self.embed_width, "dtype": self.dtype}
        if self.claim:
            d["claim"] = self.claim
        return d

    @classmethod
    def from_dict(cls, d: Any, what: str = "item source") -> ItemSource:
        d = _mapping(d, what)
        _keys(d, what, ("endpoint", "embed_width", "dtype", "claim"), required=("endpoint", "embed_width", "dtype"))
        try:
            return cls(d["endpoint"], d["embed_width"], d["dtype"], d.get("claim", ""))
        except ValueError as e:
            raise ValueError(f"{what}: {e}") from None


@dataclass(frozen=True)
class ECTransferParams:
    """A request's ``ec_transfer_params`` on the LM: the encoder of each item, by
    identifier (vLLM's ``mm_hash``). Items not named here are encoded by the LM."""

    items: Mapping[str, ItemSource] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"items": {ident: src.to_dict() for ident, src in self.items.items()}}

    @classmethod
    def from_dict(cls, d: Any) -> ECTransferParams:
        """``None`` (a request without params) is no items."""
        if d is None:
            return cls()
        d = _mapping(d, "ec_transfer_params")
        _keys(d, "ec_transfer_params", ("items",))
        items = _mapping(d.get("items") or {}, "ec_transfer_params.items")
        return cls({_str(ident, "an item identifier", nonempty=True): ItemSource.from_dict(src, f"item {ident!r}")
                    for ident, src in items.items()})

    def endpoints(self) -> list[str]:
        """The encoders named, each once, sorted."""
        return sorted({src.endpoint for src in self.items.values()})


@dataclass(frozen=True)
class TransferReport:
    """What the LM's engine did for a multimodal request's items (none for a text-only one)."""

    local_encoder_runs: int = 0
    """Items vLLM encoded on the LM itself."""
    transferred_items: int = 0
    """Items whose embedding arrived from an encoder."""
    transfer_ms: float = 0.0
    """How long the request was deferred for its embeddings."""
    transports: Mapping[str, str] = field(default_factory=dict)
    """Per encoder endpoint, the transport the engine negotiated (only with transferred items)."""


@dataclass(frozen=True)
class ConsumerFinished:
    """The consumer half's ``request_finished`` result. As a dict, keys are left out
    when empty (a text-only request that went well gives ``{}``, which the facade
    hands vLLM as ``None``)."""

    error: str = ""
    """Why the request's encoder outputs could not be had (empty: they could)."""
    failed_endpoints: tuple[str, ...] = ()
    """Encoders that failed it, sorted: the gateway re-encodes those items elsewhere."""
    report: TransferReport | None = None
    """Per-request counts and timings; None for a request without multimodal items."""

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"error": self.error} if self.error else {}
        if self.failed_endpoints:
            out["failed_endpoints"] = list(self.failed_endpoints)
        if self.report is not None:
            r = self.report
            out.update(local_encoder_runs=r.local_encoder_runs, transferred_items=r.transferred_items,
                       transfer_ms=r.transfer_ms)
            if r.transports:
                out["transports"] = dict(r.transports)
        return out

    @classmethod
    def from_dict(cls, d: Any) -> ConsumerFinished:
        """``None`` (vLLM drops the params of a request it failed) is nothing to report."""
        if d is None:
            return cls()
        what = "consumer finished info"
        d = _mapping(d, what)
        _keys(d, what, ("error", "failed_endpoints", "local_encoder_runs", "transferred_items", "transfer_ms",
                        "transports"))
        failed = d.get("failed_endpoints", [])
        if not isinstance(failed, (list, tuple)):
            raise ValueError(f"{what}: failed_endpoints must be a list, got {failed!r}")
        report = None
        if any(k in d for k in ("local_encoder_runs", "transferred_items", "transfer_ms", "transports")):
            transports = _mapping(d.get("transports", {}), f"{what}: transports")
            report = TransferReport(
                _int(d.get("local_encoder_runs", 0), f"{what}: local_encoder_runs"),
                _int(d.get("transferred_items", 0), f"{what}: transferred_items"),
                _float(d.get("transfer_ms", 0.0), f"{what}: transfer_ms"),
                {_str(e, f"{what}: a transports endpoint"): _str(t, f"{what}: transport of {e!r}")
                 for e, t in transports.items()})
        return cls(_str(d.get("error", ""), f"{what}: error"),
                   tuple(_str(e, f"{what}: a failed endpoint", nonempty=True) for e in failed), report)

    def then(self, other: ConsumerFinished) -> ConsumerFinished:
        """This engine call's report and a later one's of the same API call (an encoder-decoder model's
        speech windows are one engine call each): counts added, the longest wait, every transport."""
        if other.report is None or self.report is None:
            report = other.report or self.report
        else:
            a, b = self.report, other.report
            report = TransferReport(a.local_encoder_runs + b.local_encoder_runs,
                                    a.transferred_items + b.transferred_items, max(a.transfer_ms, b.transfer_ms),
                                    {**a.transports, **b.transports})
        return ConsumerFinished(self.error or other.error,
                                tuple(sorted({*self.failed_endpoints, *other.failed_endpoints})), report)


@dataclass(frozen=True)
class FinishedItem:
    num_embeds: int
    """Embedding rows of the item."""
    modality: str
    """vLLM's modality name, e.g. ``image``."""


@dataclass(frozen=True)
class ProducerParams:
    """An encode request's ``ec_transfer_params`` on the encoder: its Encode call's claims on
    the copies it makes or reuses (``ectransfer.outbound``), one per LM that will read them
    (``claim``, then ``more``: the decode LM of an E -> P -> D request). Set by the encoder service."""

    claim: str = ""
    more: tuple[str, ...] = ()
    """Claims of the readers after the first (at most ``MAX_READERS - 1``)."""

    def __post_init__(self) -> None:
        _claim(self.claim, "claim")
        if len(self.more) >= MAX_READERS:
            raise ValueError(f"at most {MAX_READERS} readers per item, got {1 + len(self.more)}")
        for c in self.more:
            _claim(c, "claim")
            if not c:
                raise ValueError("an extra claim must not be empty")

    @property
    def claims(self) -> tuple[str, ...]:
        return (self.claim, *self.more) if self.claim else ()

    def to_dict(self) -> dict[str, Any]:
        return {"claim": self.claim, **({"more": list(self.more)} if self.more else {})}

    @classmethod
    def from_dict(cls, d: Any) -> ProducerParams:
        """``None`` (a request with no params) is no claim; anything else must be well formed."""
        if d is None:
            return cls()
        d = _mapping(d, "encode request params")
        _keys(d, "encode request params", ("claim", "more"))
        more = d.get("more", [])
        if not isinstance(more, list):
            raise ValueError("encode request params: more must be a list")
        try:
            return cls(d.get("claim", ""), tuple(more))
        except ValueError as e:
            raise ValueError(f"encode request params: {e}") from None


MAX_READERS = 2
"""LMs that may read one encoded item: the LM (or the prefill LM), and a decode LM."""

MAX_CLAIM_LEN = 64


def _claim(value: Any, what: str) -> str:
    _str(value, what)
    if len(value) > MAX_CLAIM_LEN or not value.isascii() or not value.isprintable():
        raise ValueError(f"{what} must be at most {MAX_CLAIM_LEN} printable ASCII characters, got {value[:80]!r}")
    return value


@dataclass(frozen=True)
class ProducerFinished:
    """The producer half's ``request_finished`` result."""

    items: Mapping[str, FinishedItem] = field(default_factory=dict)
    """The request's items by identifier."""
    encoder_runs: int = 0
    """Items the vision encoder ran for (the rest were already held)."""

    def to_dict(self) -> dict[str, Any]:
        return {"items": {i: {"num_embeds": it.num_embeds, "modality": it.modality} for i, it in self.items.items()},
                "encoder_runs": self.encoder_runs}

    @classmethod
    def from_dict(cls, d: Any) -> ProducerFinished:
        """``None`` (vLLM drops the params of a request it failed) is nothing to report."""
        if d is None:
            return cls()
        what = "producer finished info"
        d = _mapping(d, what)
        _keys(d, what, ("items", "encoder_runs"))
        items = {}
        for ident, it in _mapping(d.get("items", {}), f"{what}: items").items():
            it = _mapping(it, f"{what}: item {ident!r}")
            _keys(it, f"{what}: item {ident!r}", ("num_embeds", "modality"), required=("num_embeds", "modality"))
            items[_str(ident, f"{what}: an item identifier", nonempty=True)] = FinishedItem(
                _int(it["num_embeds"], f"{what}: item {ident!r} num_embeds"),
                _str(it["modality"], f"{what}: item {ident!r} modality"))
        return cls(items, _int(d.get("encoder_runs", 0), f"{what}: encoder_runs"))
