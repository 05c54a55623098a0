"""E -> P -> D in the gateway's Orchestrator, against fake encoder and LM gRPC servers: roles learned
from GetInfo, the PREFILL call then the DECODE call with the prefill LM's kv_transfer_params, one claim
per reader, failover, and the routes that stay on one LM. No vLLM, no NIXL: the engines' side is
``tests/e2e/test_pd.py`` (slow: on a 2-core host NIXL's progress threads busy-poll both cores) and the
LM-side unit tests in ``tests/unit/test_lm_kv_handoff.py``."""

from __future__ import annotations

import asyncio
import contextlib
import json

import grpc
import pytest

from epd.lm.v1 import lm_pb2
from services.gateway.values import Timings
from tests.integration.gateway_fakes import FakeLM
from tests.integration.test_gateway_failover import TEST_LIMIT_S, Cluster, collect, generate, request, tokens

pytestmark = pytest.mark.integration


def pd_cluster(both: int = 0) -> Cluster:
    """One fake encoder, a prefill LM, a decode LM, and ``both`` LMs of role both."""
    c = Cluster(n_encoders=1, n_lms=0)
    c.lms = [FakeLM("lm-P", c.world, role="prefill"), FakeLM("lm-D", c.world, role="decode"),
             *(FakeLM(f"lm-B{i}", c.world, role="both") for i in range(both))]
    return c


def calls(c: Cluster, name: str) -> list[lm_pb2.GenerateRequest]:
    return next(lm for lm in c.lms if lm.name == name).requests


def test_a_request_is_prefilled_on_p_then_decoded_on_d_with_ps_params_and_a_claim_each():
    async def body(c: Cluster):
        orch = await c.start()
        req, media = request("r1", ["img-a", "img-b"])
        timings = Timings()
        out = [r async for r in generate(orch, req, media, timings)]
        assert tokens(out) == [1, 2, 3]  # the decode LM's answer is the client's
        (p_req,), (d_req,) = calls(c, "lm-P"), calls(c, "lm-D")
        assert p_req.kv.phase == lm_pb2.KVHandoff.PREFILL and not p_req.kv.params
        assert d_req.kv.phase == lm_pb2.KVHandoff.DECODE
        assert json.loads(d_req.kv.params)["remote_engine_id"] == "lm-P"  # as the prefill LM handed it over
        assert [who for who, w, _ in c.world.log if w == "generate"] == ["lm-P", "lm-D"]
        (enc_req,) = c.encoders[0].requests
        assert enc_req.readers == 2
        for p_item, d_item in zip(p_req.items, d_req.items):
            # Each LM reads under its own claim; the decode LM gets no further claims.
            assert p_item.source.claim != d_item.source.claim
            assert list(p_item.source.extra_claims) == [d_item.source.claim]
            assert not d_item.source.extra_claims
        assert timings.prefill_lm == c.lm_addresses[0] and timings.lm == c.lm_addresses[1]
        assert timings.prefill_ms > 0

    _run(body)


def test_a_refusal_by_the_prefill_lm_is_the_answer_and_the_decode_lm_is_not_called():
    async def body(c: Cluster):
        orch = await c.start()
        c.world.lm_script = ["bad_request:temperature"]
        req, media = request("r2", [])
        out = await collect(orch, req, media)
        assert out[0].http_status == 400 and b"temperature" in out[0].openai
        assert not calls(c, "lm-D")

    _run(body)


def test_a_refusal_by_the_prefill_lm_cancels_the_encodes_no_lm_will_read():
    async def body(c: Cluster):
        orch = await c.start()
        c.world.enc_script = ["hold_encoded"]  # the encode is still going when the prefill LM refuses
        c.world.lm_script = ["bad_request:temperature"]
        req, media = request("r7", ["img-e"])
        out = await collect(orch, req, media)
        assert out[0].http_status == 400 and not calls(c, "lm-D")
        assert not orch.encodes.draining()  # cancelled, not left to end on its own (as for an answered request)
        for _ in range(200):  # the cancellation crosses the encoder's gRPC call
            if c.encoders[0].cancelled:
                break
            await asyncio.sleep(0.05)
        assert c.encoders[0].cancelled == ["r7"]

    _run(body)


def test_a_client_gone_between_the_prefill_and_the_decode_call_has_the_decode_lm_release_the_blocks():
    """The prefill LM handed over, the decode LM never answered (here: it blocks, and the client goes away):
    the gateway asks the decode LM to tell the prefill LM to let the blocks go (a RELEASE call), rather
    than leave them to the prefill LM's lease. A decode LM that answered settles them itself."""
    async def body(c: Cluster):
        orch = await c.start()
        c.world.lm_script = ["ok", "block"]
        req, media = request("r8", [])
        task = asyncio.ensure_future(collect(orch, req, media))
        d = next(lm for lm in c.lms if lm.name == "lm-D")
        while not d.requests:
            await asyncio.sleep(0.01)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        for _ in range(200):
            if d.releases:
                break
            await asyncio.sleep(0.05)
        (release,) = d.releases
        assert release.kv.phase == lm_pb2.KVHandoff.RELEASE and release.request_id == "r8"
        assert json.loads(release.kv.params)["remote_engine_id"] == "lm-P"
        req, media = request("r9", [])
        await collect(orch, req, media)  # answered by the decode LM: nothing to release
        await asyncio.sleep(0.2)
        assert len(d.releases) == 1

    _run(body)


def test_admission_counts_the_lms_that_hold_a_request_while_it_generates():
    """A prefill LM holds a request for its prompt only: admission's LM capacity counts "both" and decode
    LMs, and prefill LMs only when nothing else is left (they then serve whole requests)."""
    async def body(c: Cluster):
        orch = await c.start()
        assert orch.generating_lms() == 2  # the decode LM and the "both" LM
        by_role = {i.lm_role: i for i in orch.lms.instances.values()}
        orch.lms.eject(by_role["decode"], "test")
        orch.lms.eject(by_role["both"], "test")
        assert orch.generating_lms() == 1  # the prefill LM, serving whole requests

    _run(body, both=1)


def test_a_failed_prefill_is_retried_and_the_decode_lm_then_serves_the_whole_request():
    async def body(c: Cluster):
        orch = await c.start()
        c.world.lm_script = ["unavailable"]  # the prefill LM's call fails before any token
        req, media = request("r3", ["img-c"])
        timings = Timings()
        out = [r async for r in generate(orch, req, media, timings)]
        assert tokens(out) == [1, 2, 3] and timings.retries == 1
        (d_req,) = calls(c, "lm-D")
        assert not d_req.HasField("kv")  # the one LM left: a whole request, as any LM serves it
        assert timings.lm == c.lm_addresses[1]

    _run(body)


def test_a_decode_lm_that_cannot_load_the_kv_blames_the_prefill_lm_and_the_retry_runs_without_it():
    async def body(c: Cluster):
        orch = await c.start()
        c.world.lm_script = ["ok", "kv_unavailable"]  # P hands over; D's pull fails before any token
        req, media = request("r5", ["img-d"])
        timings = Timings()
        out = [r async for r in generate(orch, req, media, timings)]
        assert tokens(out) == [1, 2, 3] and timings.retries == 1
        assert len(calls(c, "lm-P")) == 1  # not asked again
        first, again = calls(c, "lm-D")
        assert first.kv.phase == lm_pb2.KVHandoff.DECODE
        assert not again.HasField("kv")  # the one LM left serves the whole request, its items re-encoded
        assert again.items[0].source.claim and len(c.encoders[0].requests) == 2
        assert timings.lm == c.lm_addresses[1] and not timings.prefill_lm

    _run(body)


async def _relearned(orch, address: str, role: str) -> None:
    """Until the gateway routes to ``address`` again, with ``role`` (its re-verification, in the background)."""
    inst = orch.lms.instances[address]
    while not (inst.healthy and inst.lm_role == role):
        await asyncio.sleep(0.02)


def test_a_prefill_lm_restarted_as_both_is_verified_again_and_the_request_retried_elsewhere():
    async def body(c: Cluster):
        orch = await c.start()
        c.lms[0].role = "both"  # restarted at the same address with another role; no health check saw it go
        req, media = request("r8", ["img-f"])
        timings = Timings()
        out = [r async for r in generate(orch, req, media, timings)]
        assert tokens(out) == [1, 2, 3] and timings.retries == 1  # not the client's 400
        assert ("lm-P", "role_mismatch", "r8") in c.world.log and not calls(c, "lm-P")
        (d_req,) = calls(c, "lm-D")
        assert not d_req.HasField("kv")  # the retry: the one LM left serves it whole
        await _relearned(orch, c.lm_addresses[0], "both")  # verified again (GetInfo): its new role

    _run(body)


def test_an_lm_refusing_its_role_on_the_last_attempt_is_still_verified_again():
    async def body(c: Cluster):
        orch = await c.start(max_attempts=1)
        c.lms[0].role = "both"
        req, media = request("r11", [])
        with pytest.raises(grpc.aio.AioRpcError) as e:  # the call's status
            [r async for r in generate(orch, req, media, Timings())]
        assert e.value.code().name == "FAILED_PRECONDITION"  # no attempt left: the LM's answer
        await _relearned(orch, c.lm_addresses[0], "both")  # but its role is learned again for the next one

    _run(body)


def test_a_decode_lm_restarted_as_prefill_is_verified_again_and_the_prefill_lm_serves_the_request_whole():
    async def body(c: Cluster):
        orch = await c.start()
        c.lms[1].role = "prefill"
        req, media = request("r9", [])
        timings = Timings()
        out = [r async for r in generate(orch, req, media, timings)]
        assert tokens(out) == [1, 2, 3] and timings.retries == 1
        # Refused once: the RELEASE of P's blocks does not go back to it (it refuses those too; here no
        # other decode LM is there to send it, so P's lease frees them).
        assert c.world.log.count(("lm-D", "role_mismatch", "r9")) == 1 and not calls(c, "lm-D")
        assert not c.lms[1].releases
        handed, whole = calls(c, "lm-P")
        assert handed.kv.phase == lm_pb2.KVHandoff.PREFILL and not whole.HasField("kv")
        assert timings.lm == c.lm_addresses[0] and not timings.prefill_lm
        await _relearned(orch, c.lm_addresses[1], "prefill")

    _run(body)


def test_a_decode_lm_that_fails_after_its_first_token_ends_the_stream_with_an_error():
    async def body(c: Cluster):
        orch = await c.start()
        c.world.lm_script = ["ok", "fail_after_first"]
        req, media = request("r6", [])
        got, error = [], None
        try:
            async for r in generate(orch, req, media, Timings()):
                got.append(r)
        except Exception as e:  # noqa: BLE001 - the call's status
            error = e
        assert got and error is not None  # tokens went out: no retry, the client sees the failure
        assert len(calls(c, "lm-P")) == 1 and len(calls(c, "lm-D")) == 1

    _run(body)


def test_routes_that_generate_nothing_stay_on_one_lm():
    async def body(c: Cluster):
        orch = await c.start()
        req, media = request("r4", [])
        out = [r async for r in orch.generate(req, media, Timings(), disaggregate=False)]
        assert out and sum(len(lm.requests) for lm in c.lms) == 1
        assert not any(r.HasField("kv") for lm in c.lms for r in lm.requests)

    _run(body)


def test_a_mixed_deployment_sends_a_request_to_the_idle_both_lm_when_the_decode_lm_is_busy():
    async def body(c: Cluster):
        orch = await c.start()
        d = next(i for i in orch.lms.instances.values() if i.lm_role == "decode")
        d.outstanding = 3  # busier than the idle "both" LM
        req, media = request("r5", [])
        await collect(orch, req, media)
        assert len(calls(c, "lm-B0")) == 1 and not calls(c, "lm-P") and not calls(c, "lm-D")
        d.outstanding = 0
        req, media = request("r6", [])
        await collect(orch, req, media)
        assert len(calls(c, "lm-P")) == 1 and len(calls(c, "lm-D")) == 1

    _run(body, both=1)


def _run(body, both: int = 0) -> None:
    async def main():
        c = pd_cluster(both)
        try:
            await asyncio.wait_for(body(c), TEST_LIMIT_S)
        finally:
            await c.close()

    asyncio.run(main())
