"""The gateway's Responses state (services/gateway/responses.py): a response id carries its home LM and its
owner tenant under the deployment's state secret, so any gateway with that secret routes it with no shared
table, a forged or altered id is 404, another tenant's id is 404, and nothing is recorded per response."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest

from epd.lm.v1 import lm_pb2
from services.gateway.config import GatewayConfig
from services.gateway.core import RequestCore
from services.gateway.errors import ApiError
from services.gateway.responses import RESPONSE_ID_RE, SECRET_ENV, ResponseIds, named_response

pytestmark = pytest.mark.unit

SECRET = b"s" * 32
LMS = ["10.0.0.1:7000", "10.0.0.2:7000"]


class _Ticket:
    def release(self):
        pass

    def drop_encoder(self):
        pass


class _Orch:
    """An orchestrator over ``lms`` whose one LM call renders the body for ``answer_from`` and answers as
    vLLM's Responses routes do: the body's ``request_id`` is a new response's id (a GET's is in its path)."""

    def __init__(self, lms=LMS, answer_from=LMS[1]):
        self.lms = SimpleNamespace(instances=dict.fromkeys(lms))
        self.answer_from = answer_from
        self.bodies = []

    def lm_wait_reason(self):
        return None

    def encodes_remotely(self, n):
        return False

    def generating_lms(self):
        return 1

    class admission:
        @staticmethod
        async def admit(remote, tenant=None, items=0):
            return _Ticket()

    async def generate(self, req, media, timings, body=None, ticket=None, lm=None, disaggregate=True):
        home = lm or self.answer_from
        sent = json.loads(body.render(req, home=home))
        self.bodies.append(sent)
        timings.lm = home
        rid = sent.get("request_id") or req.openai.path.removesuffix("/cancel").rsplit("/", 1)[-1]
        yield lm_pb2.GenerateResponse(openai=json.dumps({"id": rid, "object": "response"}).encode(),
                                      http_status=200, content_type="application/json")


def _core(secret_file: str = "", orch: _Orch | None = None) -> RequestCore:
    cfg = GatewayConfig(lms=",".join(LMS), state_secret_file=secret_file)
    return RequestCore(cfg, orch or _Orch())


def _secret_file(tmp_path, *secrets: bytes) -> str:
    path = tmp_path / "state-secret"
    path.write_bytes(b"# the deployment's state secret\n" + b"\n".join(secrets) + b"\n")
    return str(path)


def _admit(core: RequestCore, api: str, body: dict | None, path: str = "", tenant: str = "alice"):
    async def run():
        raw = json.dumps(body).encode() if body is not None else b""
        admitted = await core.admit(api, raw, client_id="c", id_given=False, path=path, tenant=tenant)
        try:
            return admitted, [m async for m in admitted.generate()]
        finally:
            admitted.close()

    return asyncio.run(run())


def _store(core: RequestCore, tenant: str = "alice", **body) -> str:
    """A response ``tenant`` stores through ``core``: its id, as the client receives it."""
    _, answer = _admit(core, "responses", {"input": "hi", **body}, tenant=tenant)
    return json.loads(answer[0].openai)["id"]


def test_a_minted_id_names_its_home_for_its_owner_and_for_no_one_else():
    ids = ResponseIds([SECRET])
    rid = ids.mint(LMS[1], "alice")
    assert RESPONSE_ID_RE.fullmatch(rid) and rid != ids.mint(LMS[1], "alice")
    assert ids.home(rid, "alice", LMS) == LMS[1]
    assert ids.home(rid, "bob", LMS) is None
    assert ids.home(rid, "alice", [LMS[0]]) is None  # its LM is gone from the pool
    assert ResponseIds([b"t" * 32]).home(rid, "alice", LMS) is None  # another deployment's secret
    for odd in (None, 7, ["x"], "resp_" + "a" * 32, rid.upper(), rid + "0", "resp_" + "a" * (1 << 16)):
        assert ids.home(odd, "alice", LMS) is None


def test_an_id_whose_home_or_owner_is_altered_is_refused():
    ids = ResponseIds([SECRET])
    rid = ids.mint(LMS[0], "alice")
    other_home = ids.mint(LMS[1], "alice")
    # The id's parts: resp_, nonce (32), home tag (16), MAC (32).
    moved = rid[:37] + other_home[37:53] + rid[53:]  # another LM's tag, the MAC kept
    assert ids.home(moved, "alice", LMS) is None
    for i in range(5, len(rid)):  # any one digit changed, in the nonce, the tag or the MAC
        flipped = rid[:i] + ("0" if rid[i] != "0" else "1") + rid[i + 1:]
        assert ids.home(flipped, "alice", LMS) is None, i


def test_a_second_gateway_with_the_same_secret_finds_the_home_and_owner_of_an_id_the_first_minted(tmp_path):
    secret = _secret_file(tmp_path, SECRET)
    rid = _store(_core(secret))
    replica, restarted = _core(secret), _core(secret)  # another replica; a restart: nothing of the first shared
    admitted, _ = _admit(replica, "responses_get", None, f"/v1/responses/{rid}")
    assert admitted.pinned == LMS[1]
    admitted, _ = _admit(restarted, "responses_cancel", {}, f"/v1/responses/{rid}/cancel")
    assert admitted.pinned == LMS[1]
    admitted, _ = _admit(replica, "responses", {"input": "go on", "previous_response_id": rid})
    assert admitted.pinned == LMS[1]


def test_another_tenant_a_forged_id_and_an_id_of_a_gone_lm_are_404_before_any_lm(tmp_path):
    secret = _secret_file(tmp_path, SECRET)
    rid = _store(_core(secret))
    forged = rid[:-1] + ("0" if rid[-1] != "0" else "1")
    orch = _Orch()
    core = _core(secret, orch)
    cases = [("bob", rid), ("alice", forged), ("alice", "resp_" + "0" * 32)]
    for tenant, named in cases:
        for api, body, path in [("responses_get", None, f"/v1/responses/{named}"),
                                ("responses_cancel", {}, f"/v1/responses/{named}/cancel"),
                                ("responses", {"input": "go on", "previous_response_id": named}, "")]:
            with pytest.raises(ApiError) as e:
                _admit(core, api, body, path, tenant=tenant)
            assert e.value.status == 404 and e.value.message == f"Response with id '{named}' not found."
    gone = _core(secret, _Orch(lms=[LMS[0]]))  # its LM left the pool (a restart elsewhere holds nothing)
    with pytest.raises(ApiError) as e:
        _admit(gone, "responses_get", None, f"/v1/responses/{rid}")
    assert e.value.status == 404
    assert orch.bodies == []  # no LM was asked


def test_a_follow_up_is_stored_on_the_same_lm_under_a_fresh_id_for_the_same_owner(tmp_path):
    core = _core(_secret_file(tmp_path, SECRET))
    first = _store(core)
    second = _store(core, previous_response_id=first)
    assert second != first and core.responses.home(second, "alice", LMS) == LMS[1]


def test_without_a_secret_each_gateway_process_signs_with_its_own(monkeypatch):
    monkeypatch.delenv(SECRET_ENV, raising=False)
    first, second = _core(), _core()
    rid = _store(first)
    assert first.responses.home(rid, "alice", LMS) == LMS[1]
    with pytest.raises(ApiError) as e:  # another replica (or a restart): as an id it never stored
        _admit(second, "responses_get", None, f"/v1/responses/{rid}")
    assert e.value.status == 404


def test_the_secret_comes_from_the_environment_when_no_file_names_it(monkeypatch):
    monkeypatch.setenv(SECRET_ENV, SECRET.decode())
    rid = _store(_core())
    assert ResponseIds([SECRET]).home(rid, "alice", LMS) == LMS[1]
    monkeypatch.setenv(SECRET_ENV, "short")
    with pytest.raises(ValueError, match=f"{SECRET_ENV} is 5 bytes; at least 32"):
        _core()


def test_a_rotated_secret_file_mints_with_its_first_secret_and_verifies_with_every_one(tmp_path):
    old_id = ResponseIds([SECRET]).mint(LMS[0], "alice")
    new = b"n" * 40
    core = _core(_secret_file(tmp_path, new, SECRET))
    assert core.responses.home(old_id, "alice", LMS) == LMS[0]
    assert ResponseIds([new]).home(_store(core), "alice", LMS) == LMS[1]


@pytest.mark.parametrize("content, why", [(b"", "holds no secret"), (b"# only a comment\n\n", "holds no secret"),
                                          (b"x" * 32 + b"\nshort\n", "secret 2 of .* is 5 bytes")])
def test_a_secret_file_that_will_not_do_is_refused_without_showing_a_secret(tmp_path, content, why):
    path = tmp_path / "secret"
    path.write_bytes(content)
    with pytest.raises(ValueError, match=why) as e:
        _core(str(path))
    assert "x" * 32 not in str(e.value) and "short" not in str(e.value)
    with pytest.raises(ValueError, match="--state-secret-file"):
        _core(str(tmp_path / "missing"))


def test_store_false_and_every_other_answer_leave_no_state_in_the_gateway(tmp_path):
    core = _core(_secret_file(tmp_path, SECRET))
    before = dict(vars(core.responses))
    for _ in range(3):
        _store(core, store=False)
        _store(core)
    assert vars(core.responses) == before  # the ids carry it all: no table to fill or churn
    assert not hasattr(core, "homes")


def test_the_lm_learns_the_tenants_weight_for_its_share_of_the_response_store(tmp_path):
    cfg = GatewayConfig(lms=",".join(LMS), state_secret_file=_secret_file(tmp_path, SECRET))
    core = RequestCore(cfg, _Orch(), quota=lambda tenant: SimpleNamespace(share=3.0 if tenant == "alice" else 1.0,
                                                                          max_background=None))
    admitted, _ = _admit(core, "responses", {"input": "hi"})
    assert admitted.req.tenant_weight == 3.0


def test_the_named_response_is_a_previous_id_string_or_the_paths_id():
    assert named_response("responses", {"previous_response_id": "resp_1"}, "") == "resp_1"
    assert named_response("responses", {"previous_response_id": 7}, "") is None  # vLLM's 400 to give
    assert named_response("responses", {}, "") is None
    assert named_response("responses_get", {}, "/v1/responses/resp_2") == "resp_2"
    assert named_response("responses_cancel", {}, "/v1/responses/resp_3/cancel") == "resp_3"
    assert named_response("chat", {"previous_response_id": "resp_1"}, "") is None


def test_epd_gateway_refuses_a_secret_file_that_will_not_do_before_it_starts(tmp_path, capsys):
    from services import cli

    path = tmp_path / "secret"
    path.write_bytes(b"short\n")
    ns = cli.build_parser().parse_args(["gateway", "--lms", "127.0.0.1:1", "--state-secret-file", str(path)])
    assert cli.run_service(ns) == 2
    assert "secret 1 of" in capsys.readouterr().err
