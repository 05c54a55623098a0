"""Each LM's ``--lm-max-outstanding`` holds for the whole front door, not only the pooled count: two whole
gateways (``server.serve``) over one real redis-server, whose views of the fleet differ as two replicas'
do while one's DNS lags (one sees both LMs, the other only the first), against two fake LMs that hold every
call open. Without a place per LM the second gateway, seeing both LMs idle from where it stands, would
send one of its requests to the LM the first has filled."""

from __future__ import annotations

import asyncio

import pytest

from tests.integration.gateway_fakes import FakeLM, World, serve_fake, wait_until
from tests.integration.gateway_harness import Gateway, chat, metric

pytestmark = pytest.mark.integration

TEST_LIMIT_S = 120.0  # a hang guard


def test_an_lm_full_for_the_front_door_is_passed_over_by_a_replica_that_sees_it_idle(own_store):
    async def body():
        world = World()
        first, second = FakeLM("lm1", world), FakeLM("lm2", world)
        (s1, a1), (s2, a2) = await serve_fake(first), await serve_fake(second)
        world.lm_script = ["block"] * 4  # every call held open until the test ends
        common = dict(state_store=own_store.url, state_store_password_file=own_store.password_file,
                      state_store_replicas=2, lm_max_outstanding=2, admission_wait_s=30.0)
        tasks: list[asyncio.Task] = []
        try:
            async with Gateway(lms=a1, state_store_replica=0, **common) as lagging, \
                    Gateway(lms=f"{a1},{a2}", state_store_replica=1, **common) as whole:
                for gw, n in ((lagging, 1), (whole, 2)):
                    await gw.poll(lambda gw=gw: gw.get("/health"),
                                  lambda r, n=n: r[0] == 200 and sum(r[1].get("lms", {}).values()) == n, 30,
                                  f"{n} LM(s) admitted")
                tasks += [asyncio.create_task(lagging.post("/v1/chat/completions", chat(f"a{i}"))) for i in range(2)]
                await wait_until(lambda: len(first.requests) == 2, 30, "the lagging replica's two on lm1")
                tasks += [asyncio.create_task(whole.post("/v1/chat/completions", chat(f"b{i}"))) for i in range(2)]
                await wait_until(lambda: len(second.requests) == 2, 30, "the other replica's two on lm2")
                assert len(first.requests) == 2, [r.request_id for r in first.requests]
                assert await metric(whole, "epd_gateway_lm_place_overflow_total") == 0
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
        finally:
            await s1.stop(0)
            await s2.stop(0)

    asyncio.run(asyncio.wait_for(body(), TEST_LIMIT_S))
