"""services.up helpers that need no engine."""

from __future__ import annotations

import random
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from peerauth import is_loopback
from services import up
from services.child import _ephemeral_low
from services.cli import build_parser, load_tenants
from services.common.config import from_args
from services.gateway.config import API_KEYS_ENV, GatewayConfig
from services.lm.config import LMServiceConfig
from services.startup_errors import StartupError
from services.up import Deployment, Service, free_port, gateway_admitted, gateway_key_args, up_lms


def test_free_ports_are_distinct_bindable_and_outside_the_ephemeral_range():
    random.seed(0)  # a test that seeds the global generator does not make ports repeat
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == 50
    low = _ephemeral_low()
    assert all(1024 <= p < low for p in ports)
    for p in ports[:5]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))


def test_epd_port_range_bounds_the_ports_and_a_malformed_one_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("EPD_PORT_RANGE", "41000-41199")
    ports = [free_port() for _ in range(40)]
    assert len(set(ports)) == 40 and all(41000 <= p <= 41199 for p in ports)
    for bad in ("41000", "x-y", "900-1000", "5000-4000"):
        monkeypatch.setenv("EPD_PORT_RANGE", bad)
        with pytest.raises(ValueError, match="EPD_PORT_RANGE"):
            free_port()


@pytest.mark.parametrize("prefills, decodes, lms, want", [
    (0, 0, None, 1), (1, 1, None, 0), (2, 1, None, 0),  # the defaults
    (0, 0, 2, 2), (1, 1, 1, 1),  # more LMs; a mixed deployment
])
def test_epd_ups_lms_beside_prefill_and_decode_lms(prefills, decodes, lms, want):
    assert up_lms(prefills, decodes, lms) == want


@pytest.mark.parametrize("prefills, decodes, lms", [(1, 0, None), (0, 1, 1), (-1, -1, None), (0, 0, 0), (1, 1, -1)])
def test_a_set_of_lms_that_cannot_serve_is_refused(prefills, decodes, lms):
    with pytest.raises(ValueError):
        up_lms(prefills, decodes, lms)


def test_a_gateway_counts_as_started_once_every_instance_is_admitted_not_only_its_first_lm():
    """``Deployment.start``'s readiness: /health 200 (one LM) is not enough while an encoder or another LM
    waits for a later health round (the gauge reads 0 until a check admits it)."""
    state = {"enc": 0, "lm2": 0}

    class Gateway(BaseHTTPRequestHandler):
        def do_GET(self):
            body = "" if self.path == "/health" else (
                '# TYPE epd_gateway_instance_healthy gauge\n'
                f'epd_gateway_instance_healthy{{instance="e:1",role="encoder"}} {state["enc"]}.0\n'
                'epd_gateway_instance_healthy{instance="l:1",role="lm"} 1.0\n'
                f'epd_gateway_instance_healthy{{instance="l:2",role="lm"}} {state["lm2"]}.0\n')
            self.send_response(200)
            self.end_headers()
            self.wfile.write(body.encode())

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Gateway)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        assert gateway_admitted(url, [], ["l:1"])
        assert not gateway_admitted(url, ["e:1"], ["l:1", "l:2"])
        state["enc"] = 1
        assert not gateway_admitted(url, ["e:1"], ["l:1", "l:2"])
        state["lm2"] = 1
        assert gateway_admitted(url, ["e:1"], ["l:1", "l:2"])
        assert not gateway_admitted(url, ["l:2"], [])  # the role counts too
    finally:
        server.shutdown()
        server.server_close()
    assert not gateway_admitted(url, [], ["l:1"])  # nothing listens: not started


def _pd_deployment(monkeypatch, tmp_path, **kw) -> list:
    """``epd up --host 10.1.2.3 --prefills 1 --decodes 1`` as built (nothing started): its prefill and decode
    LMs' parsed command lines. 10.1.2.3 is no address of this machine: ports are handed out unchecked."""
    ports = iter(range(41000, 41100))
    monkeypatch.setattr(up, "free_port", lambda host="127.0.0.1": next(ports))
    dep = Deployment(model="m", host="10.1.2.3", n_lms=0, n_prefills=1, n_decodes=1, security="token",
                     insecure=True, log_dir=str(tmp_path), **kw)
    parsed = [build_parser().parse_args(lm.args) for lm in dep.lms]
    assert sorted(ns.role for ns in parsed) == ["decode", "prefill"]
    return parsed


def test_epd_up_binds_nixls_side_channel_on_loopback_whatever_its_host(monkeypatch, tmp_path):
    for ns in _pd_deployment(monkeypatch, tmp_path):
        assert ns.host == "10.1.2.3" and is_loopback(ns.kv_host), (ns.role, ns.kv_host)
        assert not ns.insecure_kv_side_channel
        from_args(LMServiceConfig, ns)  # the LM's own bind rule accepts it


def test_epd_up_binds_a_side_channel_other_hosts_reach_only_with_the_opt_in(monkeypatch, tmp_path):
    for ns in _pd_deployment(monkeypatch, tmp_path, lm_args=["--kv-host", "10.1.2.3", "--insecure-kv-side-channel"]):
        assert ns.kv_host == "10.1.2.3" and from_args(LMServiceConfig, ns).insecure_kv_side_channel
    for ns in _pd_deployment(monkeypatch, tmp_path, lm_args=["--kv-host", "10.1.2.3"]):
        with pytest.raises(ValueError, match="--insecure-kv-side-channel"):
            from_args(LMServiceConfig, ns)


def test_only_the_gateway_is_given_vllm_api_key(monkeypatch, tmp_path):
    """VLLM_API_KEY is the gateway's clients' key: an LM given it would guard the /v1 routes of its in-process
    vLLM app against the gateway's own calls."""
    monkeypatch.setenv("VLLM_API_KEY", "client-key")
    envs: dict[str, dict] = {}

    def start(self, env=None):
        envs[self.name] = env
        return self

    monkeypatch.setattr(Service, "start", start)
    monkeypatch.setattr(Deployment, "_wait", lambda self, checks, t0, timeout: None)
    Deployment(model="m", log_dir=str(tmp_path), quiet=True, security="none").start()
    assert sorted(envs) == ["encoder", "gateway", "lm"]
    assert envs["gateway"]["VLLM_API_KEY"] == "client-key"
    assert "VLLM_API_KEY" not in envs["encoder"] and "VLLM_API_KEY" not in envs["lm"]
    assert envs["lm"]["PYTHONUNBUFFERED"] == "1"


def test_epd_up_passes_its_keys_file_flag_to_the_gateway_only_when_set():
    assert gateway_key_args("") == []
    ns = build_parser().parse_args(["up", "--api-key", "a", "b", "--api-keys-file", "k.jsonl"])
    assert gateway_key_args(ns.api_keys_file) == ["--api-keys-file", "k.jsonl"]


def _started(monkeypatch, **kw) -> tuple[Deployment, dict[str, tuple[list[str], dict]]]:
    """A Deployment started with ``kw``, every service's (argv, environment) recorded instead of run."""
    seen: dict[str, tuple[list[str], dict]] = {}

    def start(self, env=None):
        seen[self.name] = (self.argv, env)
        return self

    monkeypatch.setattr(Service, "start", start)
    monkeypatch.setattr(Deployment, "_wait", lambda self, checks, t0, timeout: None)
    return Deployment(model="m", quiet=True, **kw).start(), seen


def test_epd_ups_api_keys_reach_the_gateway_by_its_environment_and_no_command_line(monkeypatch, tmp_path):
    monkeypatch.delenv(API_KEYS_ENV, raising=False)
    dep, seen = _started(monkeypatch, log_dir=str(tmp_path), security="none", api_keys=["sk-one", "sk-two"])
    for name, (argv, _) in seen.items():
        assert not any("sk-one" in a or "sk-two" in a for a in argv) and "--api-key" not in argv, name
    assert seen["gateway"][1][API_KEYS_ENV] == "sk-one\nsk-two"
    assert API_KEYS_ENV not in seen["encoder"][1] and API_KEYS_ENV not in seen["lm"][1]
    assert "sk-one" not in repr(dep)
    # and the gateway takes them from there, as it would take --api-key's
    cfg = from_args(GatewayConfig, build_parser().parse_args(["gateway", "--lms", "l:1"]))
    tenants = load_tenants(cfg, {API_KEYS_ENV: seen["gateway"][1][API_KEYS_ENV], "VLLM_API_KEY": "sk-env"})
    assert tenants.required and tenants.identify("Bearer sk-two") is not None
    assert tenants.identify("Bearer sk-env") is None  # as --api-key, they win over VLLM_API_KEY


def test_no_service_of_epd_up_carries_a_secret_on_its_command_line(monkeypatch, tmp_path):
    """Every user of the host can read a command line (ps): the token, the TLS key and the API keys go
    by files (0600) and the environment; only their paths may be on it."""
    dep, seen = _started(monkeypatch, log_dir=str(tmp_path), security="tls", api_keys=["sk-secret-key"])
    secrets = ["sk-secret-key", (tmp_path / "auth-token").read_text().strip(),
               *(tmp_path / "tls" / "key.pem").read_text().splitlines()[1:-1]]
    assert len(seen) == 3 and all(secrets)
    for name, (argv, _) in seen.items():
        line = " ".join(argv)
        assert not [s for s in secrets if s in line], name
    assert (tmp_path / "auth-token").stat().st_mode & 0o777 == 0o600
    assert (tmp_path / "tls" / "key.pem").stat().st_mode & 0o777 == 0o600


def test_epd_up_refuses_a_model_not_in_the_cache_before_it_starts_anything(monkeypatch):
    from huggingface_hub.errors import LocalEntryNotFoundError

    def not_cached(cfg):
        raise RuntimeError("while reading the model") from LocalEntryNotFoundError("no cached snapshot")

    monkeypatch.setattr(up, "configure_process_env", lambda: None)
    monkeypatch.setattr(up, "is_encoder_decoder", not_cached)
    monkeypatch.setattr(up, "Deployment", lambda **kw: pytest.fail("a service was set up"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(StartupError) as e:
        up.run_up("org/not-cached", "127.0.0.1", 0, "{}", security="none")
    assert "huggingface-cli download org/not-cached" in str(e.value) and "HF_HUB_OFFLINE=0" in str(e.value)
    with pytest.raises(StartupError, match="no such directory"):
        up.run_up("/no/such/model/dir", "127.0.0.1", 0, "{}", security="none")
