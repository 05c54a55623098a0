"""Security settings and the LM's encoder allow-list (no servers)."""

from __future__ import annotations

import asyncio
import logging
import types

import grpc
import pytest

from epd.transfer.v1 import transfer_pb2
from peerauth import SecurityConfig
from services.certs import make_token
from services.common.errors import Forbidden
from services.lm.peers import EncoderAllowList, PeerChecker

pytestmark = pytest.mark.unit


REACHABLE = ["0.0.0.0", "10.1.2.3", "::", "epd-encoder"]


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    from services.certs import make_certs

    d = tmp_path_factory.mktemp("pki")
    return {**make_certs(str(d / "tls"), ["localhost"]), "token": make_token(str(d / "token"))}


@pytest.mark.parametrize("host", REACHABLE)
def test_a_reachable_address_without_authentication_is_refused_unless_insecure(host, caplog):
    with pytest.raises(ValueError, match="without authentication") as e:
        SecurityConfig().require_for(host, "the API")
    assert "without TLS" in str(e.value) and "--insecure" in str(e.value)
    SecurityConfig(insecure=True).require_for(host, "the API")  # warns
    assert "without authentication" in caplog.text and "allowed by --insecure" in caplog.text


@pytest.mark.parametrize("host", REACHABLE)
def test_a_reachable_address_with_the_token_alone_is_refused_unless_insecure(host, pki, caplog):
    with pytest.raises(ValueError, match="without TLS: the auth token and the embeddings would cross") as e:
        SecurityConfig(auth_token_file=pki["token"]).require_for(host, "the API")
    assert "without authentication" not in str(e.value) and "--insecure" in str(e.value)
    SecurityConfig(auth_token_file=pki["token"], insecure=True).require_for(host, "the API")  # a mesh: warns
    assert "without TLS" in caplog.text and "allowed by --insecure" in caplog.text


@pytest.mark.parametrize("host", REACHABLE)
def test_a_reachable_address_with_tls_and_authentication_is_served_without_a_warning(host, pki, caplog):
    cert = dict(tls_cert=pki["tls_cert"], tls_key=pki["tls_key"])
    SecurityConfig(**cert, auth_token_file=pki["token"]).require_for(host, "the API")  # TLS + token
    SecurityConfig(**cert, tls_ca=pki["tls_ca"]).require_for(host, "the API")  # mutual TLS
    SecurityConfig(**cert, tls_ca=pki["tls_ca"], auth_token_file=pki["token"]).require_for(host, "the API")
    assert caplog.text == ""


def test_a_reachable_address_with_a_server_certificate_but_no_caller_authentication_is_refused(pki):
    sec = SecurityConfig(tls_cert=pki["tls_cert"], tls_key=pki["tls_key"])
    with pytest.raises(ValueError, match="without authentication") as e:
        sec.require_for("10.1.2.3", "the API")
    assert "without TLS" not in str(e.value)


@pytest.mark.parametrize("host", ["127.0.0.1", "::1", "localhost"])
def test_loopback_with_the_token_alone_needs_no_tls(host, pki, caplog):
    SecurityConfig(auth_token_file=pki["token"]).require_for(host, "the API")
    assert caplog.text == ""


@pytest.mark.parametrize("host", ["127.0.0.1", "127.9.9.9", "::1", "localhost"])
def test_loopback_needs_no_authentication(host):
    SecurityConfig().require_for(host, "the API")


def test_a_certificate_without_its_key_and_an_empty_token_file_are_refused(tmp_path):
    (tmp_path / "cert.pem").write_text("x")
    with pytest.raises(ValueError, match="go together"):
        SecurityConfig(tls_cert=str(tmp_path / "cert.pem"))
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ValueError, match="empty"):
        SecurityConfig(auth_token_file=str(tmp_path / "empty"))
    with pytest.raises(ValueError, match="missing"):
        SecurityConfig(tls_ca=str(tmp_path / "missing"))


def test_the_config_travels_to_the_engine_process_as_a_dict(tmp_path):
    sec = SecurityConfig(auth_token_file=make_token(str(tmp_path / "t")), reflection=True)
    back = SecurityConfig.from_dict(sec.to_dict())
    assert back == sec and back.token == sec.token and back.authenticated


def test_without_authenticated_callers_the_lm_dials_loopback_encoders_only():
    allow = EncoderAllowList.parse("", trusted_callers=False)
    assert allow.allows("127.0.0.1:5000") and allow.allows("[::1]:5000") and allow.allows("localhost:1")
    assert not allow.allows("10.0.0.5:5000") and not allow.allows("evil.example:5000")


def test_with_authenticated_callers_an_empty_list_trusts_the_gateway():
    assert EncoderAllowList.parse("", trusted_callers=True).allows("10.0.0.5:5000")


def test_allow_list_entries_endpoints_hosts_and_networks():
    allow = EncoderAllowList.parse("enc-0:50052, 10.2.0.0/16, encoder-host", trusted_callers=True)
    assert allow.allows("enc-0:50052") and not allow.allows("enc-0:50053")
    assert allow.allows("10.2.9.9:1") and not allow.allows("10.3.0.1:1")
    assert allow.allows("encoder-host:7") and not allow.allows("127.0.0.1:7")
    assert EncoderAllowList.parse("*", trusted_callers=False).allows("203.0.113.9:1")
    with pytest.raises(ValueError):
        EncoderAllowList.parse("10.0.0.0/99", trusted_callers=False)


def test_the_lm_refuses_an_endpoint_outside_its_allow_list_without_dialing_it():
    peers = PeerChecker(transfer_pb2.CompatInfo(), "lm", [], 1.0,
                        allowed=EncoderAllowList.parse("127.0.0.1:1", trusted_callers=False))

    async def main():
        with pytest.raises(Forbidden, match="not in this LM's allowed encoders"):
            await peers.check("192.0.2.1:50052")

    asyncio.run(main())
    assert peers.transport == {}


def test_allow_list_entries_match_any_spelling_of_an_address_or_name():
    allow = EncoderAllowList.parse("2001:db8::1, [2001:db8::2]:9000, Encoder-A", trusted_callers=False)
    assert allow.allows("[2001:0db8:0:0::1]:5") and allow.allows("[2001:db8::2]:9000")
    assert not allow.allows("[2001:db8::2]:9001") and allow.allows("encoder-a:1")
    with pytest.raises(ValueError, match="not host:port"):
        EncoderAllowList.parse("enc:notaport", trusted_callers=False)


def test_a_server_with_a_ca_but_no_certificate_is_refused(tmp_path):
    from services.certs import make_certs

    pki = make_certs(str(tmp_path / "tls"), ["localhost"])
    with pytest.raises(ValueError, match="needs --tls-cert"):
        SecurityConfig(tls_ca=pki["tls_ca"]).add_port(object(), "127.0.0.1:0")


def test_certificate_files_are_written_with_their_mode_even_over_an_old_file(tmp_path):
    import os
    import stat

    old = tmp_path / "auth-token"
    old.write_text("old\n")
    os.chmod(old, 0o644)
    make_token(str(old))
    assert stat.S_IMODE(os.stat(old).st_mode) == 0o600


# --- callers that bind a non-loopback address: epd up -----------------------------------------------------------


def test_epd_up_on_a_reachable_host_uses_tls_unless_told_otherwise(tmp_path):
    from services.up import Deployment

    dep = Deployment(model="m", host="0.0.0.0", log_dir=str(tmp_path))
    assert dep.security == "tls" and dep.client_security.tls_cert and dep.client_security.token
    for svc in dep.services:
        assert "--tls-cert" in svc.args and "--auth-token-file" in svc.args and "--insecure" not in svc.args
    assert Deployment(model="m", log_dir=str(tmp_path)).security == "token"  # loopback: as before


@pytest.mark.parametrize("security", ["token", "none"])
def test_epd_up_without_tls_on_a_reachable_host_is_refused_before_starting_unless_insecure(security, tmp_path,
                                                                                           capsys):
    from services.cli import main
    from services.up import Deployment

    with pytest.raises(ValueError, match="--security tls"):
        Deployment(model="m", host="0.0.0.0", security=security, log_dir=str(tmp_path))
    assert not any(tmp_path.iterdir())  # refused before any token or certificate was made
    assert main(["up", "--model", "m", "--host", "0.0.0.0", "--security", security]) == 2
    assert "--insecure where the network is trusted" in capsys.readouterr().err
    dep = Deployment(model="m", host="0.0.0.0", security=security, insecure=True, log_dir=str(tmp_path))
    assert all("--insecure" in svc.args and "--tls-cert" not in svc.args for svc in dep.services)


# --- refused calls on the internal ports: counted, logged at a bounded rate -----------------------------------------


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _refused(reason: str) -> float:
    from prometheus_client import REGISTRY

    return REGISTRY.get_sample_value("epd_peer_refused_total", {"reason": reason}) or 0.0


def _refusal_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "peerauth.refusals"]


def test_a_flood_of_refusals_is_counted_whole_and_logged_as_a_burst_then_one_summary_per_interval(caplog):
    from peerauth.refusals import Refusals

    caplog.set_level(logging.INFO)
    clock = _Clock()
    refusals = Refusals(burst=3, interval_s=60.0, clock=clock)
    before = _refused("wrong_token"), _refused("no_token")
    for i in range(1000):
        refusals.refused("wrong_token" if i % 2 else "no_token", "/epd.lm.v1.LMService/Generate")
    assert _refused("wrong_token") - before[0] == 500 and _refused("no_token") - before[1] == 500
    lines = _refusal_lines(caplog)
    assert len(lines) == 3 and "epd_peer_refused_total" in lines[-1]  # the last of the burst says where the rest go
    clock.now += 60.0
    refusals.refused("no_token", "/epd.lm.v1.LMService/Generate")
    lines = _refusal_lines(caplog)
    assert len(lines) == 5
    assert lines[3] == "refused 997 more calls without logging each (498 for no auth token, 499 for a wrong auth token)"
    assert lines[4].startswith("refused /epd.lm.v1.LMService/Generate: no auth token")
    clock.now += 600.0
    refusals.refused("no_token", "x")  # a quiet interval (nothing held back) has no summary line
    assert len(_refusal_lines(caplog)) == 6


def test_the_token_interceptor_counts_each_refusal_by_reason_and_does_not_log_each(monkeypatch, caplog, pki):
    import peerauth
    from peerauth.refusals import Refusals

    caplog.set_level(logging.INFO)
    monkeypatch.setattr(peerauth, "REFUSALS", Refusals(burst=2, interval_s=60.0, clock=_Clock()))
    interceptor = peerauth.TokenInterceptor(SecurityConfig(auth_token_file=pki["token"]).token)
    handler = grpc.unary_unary_rpc_method_handler(lambda request, context: b"")

    async def continuation(details):
        return handler

    def call(metadata):
        details = types.SimpleNamespace(method="/epd.encoder.v1.EncoderService/Encode", invocation_metadata=metadata)
        return asyncio.run(interceptor.intercept_service(continuation, details))

    before = _refused("no_token"), _refused("wrong_token")
    for _ in range(20):
        assert call(()) is not handler
        assert call((("authorization", "Bearer wrong"),)) is not handler
    assert call((("authorization", f"Bearer {SecurityConfig(auth_token_file=pki['token']).token}"),)) is handler
    assert (_refused("no_token") - before[0], _refused("wrong_token") - before[1]) == (20, 20)
    assert len(_refusal_lines(caplog)) == 2 and not [r for r in caplog.records if r.name == "peerauth"]
