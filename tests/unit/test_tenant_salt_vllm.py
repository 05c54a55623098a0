"""Each tenant's prefix-cache namespace (``request.tenant_salt``): the salts the gateway gives vLLM pass
vLLM's own check, a client salt vLLM would refuse still reaches it unchanged (vLLM's 400), and no client
salt of one tenant can give another tenant's salt."""

from __future__ import annotations

import json

import pytest

from epd.lm.v1 import lm_pb2
from services.gateway.config import GatewayConfig
from services.gateway.lm_body import CACHE_SALT_FORBIDDEN, CACHE_SALT_MAX, tenant_salt
from services.gateway.request import parse_openai

pytestmark = pytest.mark.unit

CLIENT_SALTS = [None, "", "mine", "a" * 128, "a" * 129, "x/y", "x@y", "x\\y", "x\x00y", "a:b", 7, ["l"], "é" * 10]


def test_our_copy_of_vllms_salt_rule_is_vllms():
    from vllm.entrypoints.generate.base import protocol

    assert CACHE_SALT_FORBIDDEN == protocol._CACHE_SALT_FORBIDDEN_CHARS
    assert CACHE_SALT_MAX == protocol._MAX_CACHE_SALT_LENGTH


@pytest.mark.parametrize("client", CLIENT_SALTS, ids=repr)
def test_a_tenants_salt_passes_vllms_check_exactly_when_the_clients_own_would(client):
    from vllm.entrypoints.generate.base.protocol import validate_cache_salt
    from vllm.exceptions import VLLMValidationError

    def ok(salt) -> bool:
        try:
            validate_cache_salt(salt)
            return True
        except VLLMValidationError:
            return False

    salted = tenant_salt("tenant-a.1", client)
    assert ok(salted) == ok(client)
    if ok(client):
        assert salted.startswith("tenant-a.1:")


def test_no_client_salt_of_one_tenant_gives_another_tenants_salt():
    salts_a = {tenant_salt("a", c) for c in CLIENT_SALTS if isinstance(c, str) and c and len(c) <= 128
               and not set(c) & CACHE_SALT_FORBIDDEN} | {tenant_salt("a", None)}
    salts_b = {tenant_salt("b", None), tenant_salt("b", "a")}
    assert not salts_a & salts_b
    assert all(s.split(":", 1)[0] == "a" for s in salts_a)


def test_a_keyed_generating_request_carries_its_tenants_salt_and_an_anonymous_one_none():
    cfg = GatewayConfig(lms="lm:1")
    call = parse_openai("chat", json.dumps({"messages": [{"role": "user", "content": "hi"}]}).encode(), cfg)
    assert "cache_salt" not in json.loads(call.for_lm().render(lm_pb2.GenerateRequest(), []))
    call.salt_tenant = "acme"
    assert json.loads(call.for_lm().render(lm_pb2.GenerateRequest(), []))["cache_salt"] == "acme:"
    tok = parse_openai("tokenize", b'{"prompt": "hi"}', cfg)
    tok.salt_tenant = "acme"
    assert "cache_salt" not in json.loads(tok.for_lm().render(lm_pb2.GenerateRequest(), []))  # generating APIs only
