"""Instances that leave and join, without servers: the gateway's fleet file (services/gateway/fleet_file.py),
an instance pool that follows it and moves an instance that answers NOT_SERVING to DRAINING
(services/gateway/instances.py), and a service's drain (services/common/drain.py)."""

from __future__ import annotations

import asyncio
import json
import os

from grpc_health.v1 import health_pb2

from epd.encoder.v1 import encoder_pb2_grpc
from services.common.drain import drain
from services.common.signals import DRAINING
from services.gateway.fleet_file import FleetFile, write_fleet_file
from services.gateway.instances import InstancePool, InstanceState


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 20))


def test_the_fleet_file_is_replaced_whole_and_a_bad_one_keeps_the_last_good_fleet(tmp_path):
    path = str(tmp_path / "fleet.json")
    write_fleet_file(path, ["127.0.0.1:1"], ["127.0.0.1:2"])
    ff = FleetFile(path)
    assert ff.entries("encoder") == ["127.0.0.1:1"] and ff.entries("lm") == ["127.0.0.1:2"]
    write_fleet_file(path, None, ["127.0.0.1:2", "127.0.0.1:3"])
    assert ff.entries("encoder") is None and not ff.has("encoder")  # no key: colocated
    assert ff.entries("lm") == ["127.0.0.1:2", "127.0.0.1:3"]
    with open(path, "w") as f:
        f.write('{"lms": ["127.0.0.1:9"')  # a writer that did not rename: half a file
    assert ff.entries("lm") == ["127.0.0.1:2", "127.0.0.1:3"]
    with open(path, "w") as f:
        json.dump({"lms": "127.0.0.1:9"}, f)  # not a list
    assert ff.entries("lm") == ["127.0.0.1:2", "127.0.0.1:3"]
    os.unlink(path)
    assert ff.entries("lm") == ["127.0.0.1:2", "127.0.0.1:3"]
    assert not [n for n in os.listdir(tmp_path) if n.endswith(".tmp")]


def test_a_pool_follows_its_entries_source_adding_and_removing_instances():
    async def body():
        entries = {"now": ["127.0.0.1:1"]}
        gone: list[str] = []
        pool = InstancePool("encoder", ["127.0.0.1:1"], encoder_pb2_grpc.EncoderServiceStub,
                            entries_source=lambda: entries["now"], removed=gone.append)
        try:
            first = pool.instances["127.0.0.1:1"]
            entries["now"] = ["127.0.0.1:1", "127.0.0.1:2"]
            pool._follow_source()
            assert set(pool.instances) == {"127.0.0.1:1", "127.0.0.1:2"}
            assert pool.instances["127.0.0.1:1"] is first  # kept, not re-created
            assert pool.instances["127.0.0.1:2"].state is InstanceState.PENDING  # checked before routed to
            entries["now"] = ["127.0.0.1:2"]
            pool._follow_source()
            assert set(pool.instances) == {"127.0.0.1:2"} and gone == ["127.0.0.1:1"]
            entries["now"] = ["not-an-address"]
            pool._follow_source()  # refused whole: the pool keeps what it has
            assert set(pool.instances) == {"127.0.0.1:2"}
        finally:
            await pool.close()

    run(body())


class FakeHealth:
    def __init__(self) -> None:
        self.status = health_pb2.HealthCheckResponse.SERVING

    async def Check(self, request, timeout=None):
        return health_pb2.HealthCheckResponse(status=self.status)


def test_an_admitted_instance_that_answers_not_serving_is_draining_and_never_routed_while_another_serves():
    async def body():
        pool = InstancePool("encoder", ["127.0.0.1:1", "127.0.0.1:2"], encoder_pb2_grpc.EncoderServiceStub)
        try:
            health = {a: FakeHealth() for a in pool.instances}
            for a, inst in pool.instances.items():
                inst.health = health[a]
            await pool.check_all()
            assert len(pool.healthy()) == 2
            leaving = pool.instances["127.0.0.1:1"]
            leaving.outstanding = 1  # a call in flight on it goes on
            health["127.0.0.1:1"].status = health_pb2.HealthCheckResponse.NOT_SERVING
            await pool.check_all()
            assert leaving.state is InstanceState.DRAINING and leaving.outstanding == 1
            assert [i.address for i in pool.healthy()] == ["127.0.0.1:2"]
            assert pool.ejected() == [] and pool.draining() == [leaving]
            pool.eject(leaving, "health check failed: UNAVAILABLE")  # it exited: still leaving, not ejected
            assert leaving.state is InstanceState.DRAINING
            health["127.0.0.1:1"].status = health_pb2.HealthCheckResponse.SERVING  # restarted there
            await pool.check_all()
            assert leaving.state is InstanceState.ADMITTED
            leaving.outstanding = 0
        finally:
            await pool.close()

    run(body())


def test_a_pending_instance_that_answers_not_serving_stays_pending():
    async def body():
        pool = InstancePool("encoder", ["127.0.0.1:1"], encoder_pb2_grpc.EncoderServiceStub)
        try:
            inst = pool.instances["127.0.0.1:1"]
            inst.health = FakeHealth()
            inst.health.status = health_pb2.HealthCheckResponse.NOT_SERVING
            await pool.check_all()
            assert inst.state is InstanceState.PENDING
        finally:
            await pool.close()

    run(body())


def test_drain_turns_not_serving_then_waits_until_idle_at_least_quiet_s_after():
    async def body():
        serving: list[bool] = []
        busy = {"calls": 2}

        async def set_serving(v: bool) -> None:
            serving.append(v)

        async def idle() -> bool:
            busy["calls"] = max(0, busy["calls"] - 1)  # one call ends per check
            return busy["calls"] == 0

        t0 = asyncio.get_running_loop().time()
        assert await drain(set_serving, idle, grace_s=10, quiet_s=0.3, poll_s=0.05) is True
        assert serving == [False] and DRAINING._value.get() == 1
        assert asyncio.get_running_loop().time() - t0 >= 0.3

        async def never() -> bool:
            return False

        assert await drain(set_serving, never, grace_s=0.2, quiet_s=0.1, poll_s=0.05) is False
        DRAINING.set(0)

    run(body())


def test_an_encoder_or_lm_that_exits_leaves_the_fleet_file_and_the_others_stay(tmp_path):
    """``epd up``'s loop (``Deployment.exited``): one that exited by itself is taken out; the last LM may not
    be removed on purpose; every instance's flags carry the deployment's drain grace."""
    import subprocess

    import pytest

    from services.cli import build_parser
    from services.up import Deployment
    from services.up_elastic import watch

    dep = Deployment(model="m", n_encoders=2, n_lms=2, security="none", log_dir=str(tmp_path), drain_grace_s=7)
    assert json.load(open(dep.fleet_file)) == {"encoders": [e.address for e in dep.encoders],
                                                "lms": [lm.address for lm in dep.lms]}
    assert {build_parser().parse_args(s.args).drain_grace_s for s in [*dep.encoders, *dep.lms]} == {7.0}
    gone, kept = dep.encoders[0], dep.encoders[1]
    gone.proc = subprocess.Popen(["true"], start_new_session=True)  # as Service.start does
    gone.proc.wait()
    for svc in [kept, *dep.lms]:
        svc.proc = subprocess.Popen(["sleep", "30"], start_new_session=True)
    try:
        assert dep.exited() == [gone] and dep.exited() == []
        assert json.load(open(dep.fleet_file))["encoders"] == [kept.address]
        assert dep.services[-1] is dep.gateway and gone not in dep.services
        dep.remove(dep.lms[0], grace=5)
        with pytest.raises(ValueError, match="last LM"):
            dep.remove(dep.lms[0])
        assert json.load(open(dep.fleet_file))["lms"] == [dep.lms[0].address]
        assert watch(dep, {"now": True}) == 0  # a signal
        dep.gateway.proc = subprocess.Popen(["true"], start_new_session=True)
        dep.gateway.proc.wait()
        assert watch(dep, {"now": False}) == 1  # the gateway's exit ends the deployment
    finally:
        for svc in [kept, *dep.lms]:
            svc.proc.kill()
            svc.proc.wait()
