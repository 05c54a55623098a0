"""LM service configuration. The connector's defaults are ``ConnectorConfig``'s (declared once there)."""

from __future__ import annotations

import ipaddress
import json
from dataclasses import dataclass, field
from typing import Any

from ectransfer import factory
from ectransfer.connector.config import ConnectorConfig
from peerauth import is_loopback
from services.common.config import transport_list
from services.common.media import MediaConfig
from services.lm.kv_peers import parse_peers


@dataclass
class FrontendConfig:
    """``vllm serve``'s front-end flags that mean something here (the same names and meaning)."""

    served_model_name: str = ""
    """Model name(s) the API answers to, comma-separated (default: the --model value)."""
    chat_template: str = ""
    """Chat template (a file or the template itself; default: the model's)."""
    chat_template_content_format: str = "auto"
    """How message content is given to the chat template: auto, string or openai (vLLM's flag)."""
    enable_auto_tool_choice: bool = False
    """Let the model choose tool calls (tool_choice "auto"); needs --tool-call-parser."""
    tool_call_parser: str = ""
    """vLLM tool-call parser for the model's output (e.g. hermes, llama3_json)."""
    reasoning_parser: str = ""
    """vLLM reasoning parser (e.g. deepseek_r1, qwen3); also gates structured outputs."""
    default_chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    """Chat-template kwargs every request gets unless it sets them (JSON)."""
    generation_config: str = "auto"
    """Sampling defaults: "auto" (the model's generation_config.json), "vllm" (vLLM's), or a folder."""
    enable_prompt_tokens_details: bool = False
    """Report cached prompt tokens in usage (vLLM's flag)."""
    enable_force_include_usage: bool = False
    """Usage in every streamed response (vLLM's flag)."""
    return_tokens_as_token_ids: bool = False
    """Logprob tokens as "token_id:N" (vLLM's flag)."""

    def engine_args(self) -> dict[str, Any]:
        """The part vLLM keeps in the engine's config (sampling defaults, reasoning, names)."""
        kw: dict[str, Any] = {"generation_config": self.generation_config}
        if self.reasoning_parser:
            kw["reasoning_parser"] = self.reasoning_parser
        if self.served_model_name:
            kw["served_model_name"] = [n for n in self.served_model_name.split(",") if n]
        return kw

    def serve_argv(self, model: str) -> list[str]:
        argv = ["--model", model, "--chat-template-content-format", self.chat_template_content_format]
        if self.served_model_name:
            argv += ["--served-model-name", *[n for n in self.served_model_name.split(",") if n]]
        if self.chat_template:
            argv += ["--chat-template", self.chat_template]
        if self.enable_auto_tool_choice:
            argv.append("--enable-auto-tool-choice")
        if self.tool_call_parser:
            argv += ["--tool-call-parser", self.tool_call_parser]
        if self.default_chat_template_kwargs:
            argv += ["--default-chat-template-kwargs", json.dumps(self.default_chat_template_kwargs)]
        for flag in ("enable_prompt_tokens_details", "enable_force_include_usage", "return_tokens_as_token_ids"):
            if getattr(self, flag):
                argv.append("--" + flag.replace("_", "-"))
        return argv


ROLES = ("both", "prefill", "decode")


def every_interface(host: str) -> bool:
    """Whether binding ``host`` listens on every interface (``0.0.0.0``, ``::``, ``[::]``, ``0``, ``''``)."""
    h = host.strip().strip("[]")
    if h in ("", "0", "*"):
        return True
    try:
        return ipaddress.ip_address(h).is_unspecified
    except ValueError:
        return False  # a name: the address it resolves to is the operator's choice


def check_kv_host(kv_host: str, insecure: bool) -> None:
    """The bind rule of NIXL's side channel (unauthenticated): loopback, or another address with
    ``insecure`` (``--insecure-kv-side-channel``); never every interface. Raises ValueError."""
    if every_interface(kv_host):
        raise ValueError(f"--kv-host {kv_host!r}: NIXL's side channel takes no credentials; it never listens on "
                         "every interface. Allowed: a loopback address (the default, 127.0.0.1), or with "
                         "--insecure-kv-side-channel the internal interface the other LMs reach")
    if not (is_loopback(kv_host) or insecure):
        raise ValueError(f"--kv-host {kv_host}: NIXL's side channel takes no credentials: whoever reaches it gets "
                         "this engine's NIXL agent metadata, and with it the KV blocks of every request here. "
                         "Allowed: a loopback address (the default, 127.0.0.1: LMs on this host), or this one with "
                         "--insecure-kv-side-channel where decode LMs on other hosts need it and the network lets "
                         "only the deployment's LMs reach the port")


@dataclass
class LMServiceConfig(FrontendConfig, MediaConfig):
    """The service's own fields; ``FrontendConfig`` adds ``vllm serve``'s front-end flags
    (chat template, tool-call and reasoning parsers, served model name, ...), ``MediaConfig``
    the limits on the media this LM decodes itself (data: URLs the gateway sends when the LM
    encodes a request's items: local placement, fallback, colocated)."""

    host: str = "127.0.0.1"
    """Address of the API port (Generate, GetInfo, health; reflection with --reflection)."""
    port: int = 50061
    """API port (0 picks a free one)."""
    metrics_port: int = 0
    """Prometheus /metrics port (0: disabled)."""
    metrics_host: str = "127.0.0.1"
    """Address of --metrics-port, loopback whatever --host is: plain HTTP, open to this host. Any other address
    needs what --host needs there (TLS and authenticated scrapers, or --insecure) and serves HTTPS with
    --tls-cert, asking a client certificate (--tls-ca) and the token (--auth-token-file) where set."""
    staging_mib: float = ConnectorConfig.staging_bytes / (1 << 20)
    """Inbound staging for encoder outputs (transfers wait when it is full)."""
    transports: str = factory.AUTO
    """Transports this LM may use, best first (comma-separated; allowed: auto, cuda_ipc, shm, grpc).
    ``auto``: cuda_ipc,shm,grpc where the engine has CUDA and cupy, else shm,grpc. The first one
    whose probe succeeds is used; a single name forces it (the handshake fails if it cannot work)."""
    transfer_timeout_s: float = ConnectorConfig.transfer_timeout_s
    """An item with no data from its encoder within this time fails its request."""
    handshake_timeout_s: float = 5.0
    """Compatibility handshake with a new encoder endpoint."""
    drain_grace_s: float = 30.0
    """On SIGTERM: how long this instance may take to finish the work it holds before it stops (it turns
    NOT_SERVING at once, so gateways route it nothing new; services/common/drain.py). What is still in flight
    then is cut (the gateway retries it elsewhere before its first token). 0: stop at once. A supervisor's
    kill timeout (Kubernetes' terminationGracePeriodSeconds) must be longer."""
    allowed_encoders: str = ""
    """Encoder Transfer endpoints this LM may fetch embeddings from, comma-separated: host:port, a host or
    address (any port), a CIDR such as 10.0.0.0/8, or * (any). Empty: any endpoint when callers must
    authenticate (--auth-token-file or mutual TLS: the gateway's word is trusted), else loopback only."""

    role: str = "both"
    """both (prefill and decode each request here), prefill (compute a prompt's KV cache and hand it to a
    decode LM over NIXL; generate nothing) or decode (load that KV from the prefill LM, then generate). The
    gateway learns each LM's role from GetInfo and sends requests E -> P -> D where it has both kinds."""
    kv_host: str = "127.0.0.1"
    """prefill/decode: the address NIXL's side channel (its handshake port, unauthenticated) binds and names
    to the other LMs (vLLM's VLLM_NIXL_SIDE_CHANNEL_HOST). Loopback, whatever --host is: LMs on this host
    only. Any other address needs --insecure-kv-side-channel; an every-interface one (0.0.0.0, ::) is
    refused always."""
    insecure_kv_side_channel: bool = False
    """prefill/decode: allow a --kv-host that other hosts reach, for a prefill LM whose decode LMs run on
    other hosts. RISK: NIXL's side channel authenticates nobody: whoever reaches it gets this engine's NIXL
    agent metadata, and with it (UCX) the KV blocks registered there, which are other users' prompts; the
    listener checks a remote peer by its address only (--kv-peers). Only where the network lets nothing but
    the deployment's LMs reach the port (a NetworkPolicy, a private network)."""
    kv_port: int = 5600
    """prefill/decode: NIXL's side-channel port (vLLM's VLLM_NIXL_SIDE_CHANNEL_PORT); give LMs sharing a
    host different ones."""
    kv_peers: str = ""
    """prefill/decode: the other hosts' addresses whose decode LMs may handshake on this LM's NIXL side
    channel, comma-separated addresses and CIDRs (e.g. 10.0.0.0/24). Empty: any host that reaches the port
    (with --insecure-kv-side-channel the network must keep everyone else off it). On this host only
    processes of this LM's own user get an answer, whatever the list says."""

    responses_store_max: int = 4096
    """With VLLM_ENABLE_RESPONSES_API_STORE=1: stored Responses this LM keeps at most, shared between tenants by
    weight; past it the oldest ended ones of the tenant furthest over its share are forgotten (a GET, cancel or
    previous_response_id naming one is then 404). vLLM alone keeps every one for the life of the process."""
    responses_store_mib: float = 256.0
    """With VLLM_ENABLE_RESPONSES_API_STORE=1: what the ended stored Responses (each one's JSON and its input
    messages, images included) may weigh, shared between tenants as --responses-store-max; past it the oldest
    of the tenant furthest over its share are forgotten."""

    holdings: bool = True
    """Publish what this LM's prefix cache holds, by media item, to the gateway (vLLM's KV cache events on a
    private socket, read back here and served by LMService.Holdings), so that a conversation's next turn is
    routed to the LM that holds its images and history (services/fleet_memory). Off: vLLM publishes nothing
    and the gateway routes this LM by load only."""
    kv_lease_s: int = 120
    """prefill: how long the prefill engine keeps a prompt's KV blocks for a decode LM that has not read them
    (NixlConnector's kv_lease_duration; vLLM's default is 30 s, which a first NIXL handshake on a busy CPU
    host can outlast). A decode LM that dies before reading costs the prefill LM these blocks this long."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.kv_lease_s < 1:
            raise ValueError(f"kv_lease_s must be >= 1, got {self.kv_lease_s}")
        if self.staging_mib <= 0:
            raise ValueError(f"staging_mib must be > 0, got {self.staging_mib}")
        if self.drain_grace_s < 0:
            raise ValueError(f"drain_grace_s must be >= 0, got {self.drain_grace_s}")
        if self.responses_store_max < 1 or self.responses_store_mib <= 0:
            raise ValueError("responses_store_max must be >= 1 and responses_store_mib > 0, got "
                             f"{self.responses_store_max} and {self.responses_store_mib}")
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}; got {self.role!r}")
        if not 0 < self.kv_port < 65536:
            raise ValueError(f"kv_port must be 1-65535, got {self.kv_port}")
        if self.disaggregated:
            check_kv_host(self.kv_host, self.insecure_kv_side_channel)
            parse_peers(self.kv_peers)

    @property
    def disaggregated(self) -> bool:
        """A prefill or decode LM (its engine has vLLM's NixlConnector)."""
        return self.role != "both"

    def transport_list(self) -> list[str]:
        return transport_list(self.transports)
