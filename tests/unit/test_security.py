"""Security settings and the LM's encoder allow-list (no servers)."""

from __future__ import annotations

import asyncio

import pytest

from ectransfer.security import SecurityConfig
from epd.common.v1 import common_pb2
from services.certs import make_token
from services.common.errors import Forbidden
from services.lm.peers import EncoderAllowList, PeerChecker

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("host", ["0.0.0.0", "10.1.2.3", "::", "epd-encoder"])
def test_a_reachable_address_without_authentication_is_refused_unless_insecure(host, tmp_path, caplog):
    with pytest.raises(ValueError, match="without authentication"):
        SecurityConfig().require_for(host, "the API")
    SecurityConfig(insecure=True).require_for(host, "the API")  # warns
    assert "--insecure" in caplog.text
    SecurityConfig(auth_token_file=make_token(str(tmp_path / "t"))).require_for(host, "the API")


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
    peers = PeerChecker(common_pb2.CompatInfo(), "lm", [], 1.0,
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
