"""Gateway configuration: one dataclass, one flag per field (``epd gateway --help``)."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field

from services.common.media_checks import MAX_AUDIO_SECONDS, MAX_IMAGE_PIXELS
from services.gateway.policies.factory import ENCODER_POLICIES, LM_POLICIES, check
from services.gateway.state.wiring import store_config

DISPATCH_MODES = ("overlap", "sequential")
BODY_COPIES = 8
"""Body budget charged per body byte (services.gateway.intake): the body, its parsed JSON, the media
decoded from it, and the LM's body built from them (the media base64-encoded again when the LM encodes
them itself: a JSON string, its bytes, the protobuf field and its serialization). Measured with
bench/hostile.py: 3 to 6 left the gateway's peak RSS up to 55 % over its budget with full-size valid
bodies; 8 within about 10 %."""
PLACEMENTS = ("auto", "encoder", "local")
API_KEYS_ENV = "EPD_API_KEYS"
"""The environment form of --api-key: the keys one per line. For whoever starts a gateway and must keep
its keys off the command line, which every user of the host can read (``epd up`` does). --api-key wins
over it, and it over VLLM_API_KEY (read by ``services.cli.load_tenants``)."""


@dataclass
class GatewayConfig:
    host: str = "127.0.0.1"
    """Address of the HTTP (OpenAI) and gRPC listeners."""
    port: int = 8000
    """OpenAI-compatible HTTP port."""
    grpc_port: int = 0
    """Native gRPC API port (0: disabled)."""
    workers: int = 1
    """Gateway processes on this host, each a whole gateway serving --port, --grpc-port and --metrics-port
    together (SO_REUSEPORT): a supervisor starts them, replaces one that dies, forwards SIGTERM, SIGINT and
    SIGHUP, and their metrics are merged on every /metrics (services/gateway/workers.py). 1: one process,
    no supervisor."""
    metrics_port: int = 0
    """Internal Prometheus port: every series (routing decisions, instances, stage times) on /metrics, and
    /health with every instance's address and state (0: disabled). The public /metrics on --port shows
    only request and refusal counts, unless --epd-facts."""
    metrics_host: str = "127.0.0.1"
    """Address of --metrics-port. Loopback: plain HTTP; any other address needs TLS and authenticated
    scrapers, as the services' API ports (docs/configuration.md, "Metrics ports")."""
    objective_window_s: float = 60.0
    """The window of epd_gateway_objective_attainment (a scaling signal on --metrics-port): the share of the
    successful requests finished in the last this many seconds that met --objective-ttft-ms and
    --objective-tpot-ms (at least 1)."""
    objective_ttft_ms: float = 2000.0
    """The time-to-first-token objective, in ms, that epd_gateway_objective_attainment counts against."""
    objective_tpot_ms: float = 200.0
    """The time-per-output-token objective (after the first token), in ms, that epd_gateway_objective_attainment
    counts against."""
    encoders: str = ""
    """Encoder API addresses, comma-separated host:port. A host name that resolves to several addresses (a
    Kubernetes headless Service) counts as one instance per address, re-resolved every --dns-refresh-s.
    None: colocated, the LMs encode media themselves."""
    lms: str = ""
    """LM API addresses, comma-separated host:port (host names as for --encoders)."""
    fleet_file: str = ""
    """A JSON file of the fleet, {"encoders": [host:port, ...], "lms": [...]}, read again whenever it changes
    (checked every --health-interval-s): a role it lists takes its addresses from it instead of
    --encoders/--lms, so instances join and leave while the gateway runs (epd up writes it, replacing it
    atomically). A file that is missing or does not parse keeps the last good fleet."""
    model_name: str = ""
    """Name served on /v1/models (default: the model of the first LM admitted). Set, every LM must agree: its
    model is this name or a path ending in it."""
    dispatch: str = "overlap"
    """overlap: Generate goes to the LM as soon as Encode has streamed every item's metadata;
    sequential: only after every item is encoded (upstream's proxy behaviour, for comparison)."""
    request_timeout_s: float = 120.0
    """End-to-end limit for one request, generation included."""
    encode_timeout_s: float = 30.0
    """Limit for one encoder to stream every item's metadata and encode it; past it the items are
    re-encoded elsewhere (if attempts are left) or the request fails with 504."""
    max_attempts: int = 3
    """Tries per request before its first token: a failed or timed-out encoder or LM is replaced by another
    instance. After the first token a failure ends the stream with an error event."""
    local_encode_fallback: bool = True
    """With no healthy encoder, let the LM encode the request's media itself (plain vLLM behaviour) instead of
    failing with 503."""
    health_interval_s: float = 1.0
    """Seconds between grpc.health.v1 checks of every instance; a failed check ejects the instance, a passing
    one re-admits it."""
    dns_refresh_s: float = 10.0
    """Seconds between re-resolutions of host names in --encoders/--lms."""
    affinity_spill: int = 4
    """Cache affinity: an image goes to the encoder its content hash maps to (rendezvous hashing) unless that
    encoder has this many more outstanding requests than the least-loaded healthy encoder."""
    held_spill: int = 16
    """An image whose output an encoder holds (--encoder-routing held) goes to that encoder unless it has
    more than this many outstanding requests beyond the least busy encoder. Larger than --affinity-spill:
    there the image costs no vision run, anywhere else a whole one."""
    encoder_routing: str = "held"
    """How an encoder is chosen for an image: held (an encoder whose outbound store or host tier holds its
    output, from the encoders' Holdings and what the gateway sent them, unless it has more than
    --held-spill requests beyond the least busy; else cache affinity) or affinity (rendezvous hashing
    only)."""
    lm_routing: str = "cache"
    """How an LM is chosen for a generating request: cache (the LM whose prefix cache holds most of its prompt:
    the longest prefix of its conversation, by the gateway's prefix keys, and its media items, from the LMs'
    Holdings and what the gateway sent them, unless it has more than --lm-spill requests beyond the least
    busy LM) or load (least outstanding requests only)."""
    lm_spill: int = 2
    """--lm-routing cache: the LM that holds most of a request's prompt is skipped for the least busy one when it has
    this many more outstanding requests (load wins over affinity past this bound: no hot spot)."""
    placement: str = "encoder"
    """Where an image request's images are encoded: encoder (the encoder service), local (the LM encodes them
    itself, as colocated vLLM does) or auto (per request: local when an LM has no request in flight and
    every healthy encoder is busy (--placement-busy-encodes), so the LM's idle cores encode instead of the
    request queueing; else encoder). auto is not the default yet: see docs/benchmarks.md."""
    placement_busy_encodes: int = 2
    """--placement auto: an encoder with this many requests in flight counts as busy (one encoding, one
    queued behind it)."""
    lm_max_outstanding: int = 64
    """Admission control: requests in flight on each LM, for the whole front door (every worker and replica);
    the deployment admits this many per healthy LM, more wait for a place (0: no admission control)."""
    encoder_max_outstanding: int = 32
    """Admission control: requests encoding per healthy encoder; more wait for a place (0: no limit)."""
    admission_queue: int = 1024
    """Requests that may wait for admission, per tenant; a request beyond it is refused at once with 429 and
    Retry-After."""
    admission_wait_s: float = 60.0
    """Longest wait for admission; then 503 with Retry-After. An admitted request is never refused later."""
    lm_max_background: int = 16
    """Background Responses requests (``"background": true``) held per generating LM: each keeps its admission
    place until its LM reports it ended, after its "queued" answer; one more is refused (429) (0: no limit).
    With client keys a tenant holds at most its share of them by weight (``services.gateway.background``)."""
    background_timeout_s: float = 600.0
    """Longest a background Responses request may run: then the gateway cancels it on its LM and its place
    goes back."""
    max_image_bytes: int = 20 << 20
    """Largest accepted encoded image (data: URL or fetched)."""
    max_image_pixels: int = MAX_IMAGE_PIXELS
    """Largest accepted image in pixels, read from its header before decoding (decompression-bomb guard)."""
    max_images: int = 8
    """Most images in one request."""
    max_audio_bytes: int = 25 << 20
    """Largest accepted encoded audio clip (data: URL, input_audio or fetched; vLLM's own default)."""
    max_audio_seconds: float = MAX_AUDIO_SECONDS
    """Longest accepted audio clip in seconds, read from its header before anything is decoded."""
    max_audios: int = 8
    """Most audio clips in one request."""
    max_video_bytes: int = 64 << 20
    """Largest accepted encoded video (data: URL or fetched)."""
    max_videos: int = 2
    """Most videos in one request."""
    fetch_timeout_s: float = 10.0
    """Limit for fetching one http(s) image URL: connect, redirects and body together."""
    fetch_max_redirects: int = 3
    """Most redirects followed for one image URL (each hop is checked again)."""
    epd_facts: bool = False
    """Tell callers about the deployment: the ``epd`` object in answers (timings, encode time, the encoders,
    LM and transports used, items transferred or encoded locally, retries, placement), every instance's
    address and state on /health, and the details of the deployment's own errors (which name instances).
    Off: a caller learns nothing of the deployment's layout or of what it has cached (an encode time or
    a transferred-item count says whether an image was seen before). For development and benchmarks."""
    max_body_readers: int = 256
    """Request bodies (REST and gRPC) being read at once; one more is refused at once (503, Retry-After)."""
    body_memory_mib: float = 1536.0
    """Memory all request bodies may hold together, from their first byte until their answer ends, counted
    eight times per body byte (the text, what is parsed from it, the media decoded, the LM's body and its
    encodings), and twice the media a request fetched; a request that does not fit is refused (503). Per
    process: with --workers N each worker holds its own (size the host's memory for N of them; a worker's
    budget must leave room for a gRPC call's pre-read share beside a limit-size body). At least eight
    times the largest body (--max-*-bytes)."""
    parse_offload_mib: float = 1.0
    """Request bodies of at least this many MiB are parsed (their JSON read, their media parts found) in a
    helper process at a lower CPU priority, one per gateway process, rather than on the event loop: a
    limit-size body holds a loop for hundreds of ms, and every other request with it
    (services/gateway/parse_pool.py). Smaller bodies are parsed on the loop, in a few ms. 0: every body
    on the loop, and no helper."""
    body_timeout_s: float = 30.0
    """A request body must arrive within this (a slow upload is cut off: 408)."""
    body_min_rate_kib: float = 64.0
    """After its first 2 s, a request body must arrive at least this fast (KiB per second), or it is cut off
    (408): a slow drip holds its share of --body-memory-mib for seconds, not --body-timeout-s."""
    answer_timeout_s: float = 15.0
    """A client must take each part of its answer (a streamed event, or a whole answer) within this plus the
    time the part's size takes at --answer-min-rate-kib; a client that reads slower is cut off, and its
    place, its body's budget and the LM's work are released at once."""
    answer_min_rate_kib: float = 64.0
    """The slowest a client may read its answer, KiB per second (with --answer-timeout-s)."""
    idle_timeout_s: float = 15.0
    """An HTTP connection must send a request's complete headers within this of opening, or of the end of its
    previous answer (keep-alive); otherwise it is closed. vllm serve's uvicorn closes idle keep-alive
    connections after 5 s."""
    api_key: list[str] = field(default_factory=list, repr=False, metadata={"nargs": "+"})
    """Client API keys, as vllm serve's --api-key (space-separated; unset: the EPD_API_KEYS environment
    variable, one key per line, else VLLM_API_KEY; prefer either, or --api-keys-file: a command line is
    visible to every user of the host): a request to a path under /v1, /v2, /inference or /cohere (any method but OPTIONS) without
    "Authorization: Bearer <one of them>" is refused with 401 {"error": "Unauthorized"}, and so is a call on
    the gRPC API without that metadata (UNAUTHENTICATED). These keys are the tenant "default"."""
    api_keys_file: str = ""
    """Tenants and their API keys, one JSON object per line: {"tenant": "name", "key": "..."} (a tenant may
    have several keys, one per line; blank lines and lines starting with # are skipped), and optionally its
    quotas (max_in_flight, max_queue, body_mib, images_per_minute, max_background: 429 past one) and weight
    (its fair share, default 1); checked as
    --api-key, beside its keys, and read again on SIGHUP (a file that does not load leaves the keys and
    quotas as they were)."""
    state_secret_file: str = ""
    """File of the deployment's state secret (one per line, each at least 32 bytes; the first signs, every
    one verifies, for rotation), shared by every gateway replica: the response ids a gateway mints carry
    their home LM and owner tenant under it, so any replica, or this one after a restart, serves them
    (services/gateway/responses.py). Unset: the EPD_STATE_SECRET environment variable, else a random
    secret per process (its stored responses are then reachable only through the process that made them)."""
    state_store: str = ""
    """The Redis or Valkey store that holds the limits of the whole front door when several gateway replicas
    serve one deployment (--lm-max-outstanding, --encoder-max-outstanding, --lm-max-background and every
    tenant's max_in_flight, images_per_minute and background places): redis://host:port[/db], rediss://
    (TLS) or unix:///path (no password in the URL). Empty: with --workers, the private store the supervisor
    starts; else this process alone, in memory (services/gateway/state/)."""
    state_store_password_file: str = ""
    """File whose first line is --state-store's password (requirepass); empty: none."""
    state_store_lease_s: float = 6.0
    """How long the places of a gateway process that stopped (kill -9, frozen, cut off from the store) stay
    held: they go back at most this long after its last heartbeat (one every third of it)."""
    state_store_unreachable: str = "share"
    """While the store does not answer (a call past 0.5 s): share (each process holds its 1/N part of every
    limit, N = --state-store-replicas x --workers, with a log line and epd_gateway_state_store_shared 0) or
    closed (whatever a limit governs is refused)."""
    state_store_replicas: int = 1
    """Gateway replicas (each of --workers processes) that share --state-store: how each process's part of a
    limit is counted while the store is unreachable."""
    state_store_replica: int = 0
    """This replica's index among --state-store-replicas, 0 to N-1."""
    fetch_allow_networks: str = ""
    """Comma-separated CIDRs that image URLs may resolve to even though they are loopback, private,
    link-local or otherwise non-public (refused by default: SSRF guard), e.g. 10.1.0.0/16."""

    def __post_init__(self) -> None:
        if not self.lm_list and not self.fleet_file:
            raise ValueError("at least one LM address is needed (--lms host:port[,host:port], or --fleet-file)")
        if self.placement not in PLACEMENTS:
            raise ValueError(f"placement must be one of {', '.join(PLACEMENTS)}, got {self.placement!r}")
        if min(self.lm_max_outstanding, self.encoder_max_outstanding, self.admission_queue,
               self.lm_max_background) < 0 or self.admission_wait_s <= 0 or self.background_timeout_s <= 0:
            raise ValueError("lm_max_outstanding, encoder_max_outstanding, admission_queue and lm_max_background "
                             "must be >= 0, admission_wait_s and background_timeout_s > 0")
        if self.dispatch not in DISPATCH_MODES:
            raise ValueError(f"dispatch must be one of {', '.join(DISPATCH_MODES)}, got {self.dispatch!r}")
        if self.workers < 1:
            raise ValueError(f"workers must be >= 1, got {self.workers}")
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {self.max_attempts}")
        if self.objective_window_s < 1 or self.objective_ttft_ms <= 0 or self.objective_tpot_ms <= 0:
            raise ValueError("objective_window_s must be >= 1 and objective_ttft_ms, objective_tpot_ms > 0")
        for name in ("request_timeout_s", "encode_timeout_s", "health_interval_s", "dns_refresh_s",
                     "fetch_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0 seconds, got {getattr(self, name)}")
        if self.max_body_readers < 1 or self.body_timeout_s <= 0 or min(self.body_min_rate_kib, self.parse_offload_mib) < 0:
            raise ValueError("max_body_readers must be >= 1, body_timeout_s > 0, body_min_rate_kib and "
                             "parse_offload_mib >= 0")
        if self.answer_timeout_s <= 0 or self.answer_min_rate_kib <= 0 or self.idle_timeout_s <= 0:
            raise ValueError("answer_timeout_s, answer_min_rate_kib and idle_timeout_s must be > 0")
        if self.body_memory_mib * (1 << 20) < BODY_COPIES * self.max_body_bytes:
            raise ValueError(f"body_memory_mib ({self.body_memory_mib:g}) must hold {BODY_COPIES} copies of the largest "
                             f"body ({self.max_body_bytes >> 20} MiB, from --max-image-bytes, --max-audio-bytes and "
                             f"--max-video-bytes): at least {-(-BODY_COPIES * self.max_body_bytes >> 20)}")
        check("encoder_routing", self.encoder_routing, ENCODER_POLICIES)
        store_config(self)  # --state-store*: raises ValueError
        check("lm_routing", self.lm_routing, LM_POLICIES)
        if self.lm_spill < 0:
            raise ValueError(f"lm_spill must be >= 0, got {self.lm_spill}")
        if self.fetch_max_redirects < 0 or self.affinity_spill < 0 or self.held_spill < 0:
            raise ValueError("fetch_max_redirects, affinity_spill and held_spill must be >= 0")
        try:
            _ = self.allowed_networks  # parses --fetch-allow-networks
        except ValueError as e:
            raise ValueError(f"fetch_allow_networks: {e} (expected CIDRs such as 10.1.0.0/16)") from None

    @property
    def max_body_bytes(self) -> int:
        """The largest request body: the largest item one modality allows, base64-encoded (4/3; images
        twice, so two full-size images fit), and 1 MiB of text."""
        largest = max(self.max_image_bytes * 2, self.max_audio_bytes, self.max_video_bytes)
        return largest * 4 // 3 + (1 << 20)

    @property
    def encoder_list(self) -> list[str]:
        return [a.strip() for a in self.encoders.split(",") if a.strip()]

    @property
    def lm_list(self) -> list[str]:
        return [a.strip() for a in self.lms.split(",") if a.strip()]

    @property
    def allowed_networks(self) -> list[ipaddress.IPv4Network | ipaddress.IPv6Network]:
        return [ipaddress.ip_network(n.strip(), strict=False) for n in self.fetch_allow_networks.split(",")
                if n.strip()]
