"""The routing policies (``services.gateway.policies``): the factory maps each flag value to its class, an
unknown one is refused with the allowed list, each policy's pick on a small table of candidates, and the
picks are functions of the request and the view alone, so two gateway replicas agree. No servers."""

from __future__ import annotations

import ast
import asyncio
import pathlib
import random
from types import SimpleNamespace

import pytest
from prometheus_client import REGISTRY

from services.fleet_memory import prefix
from services.fleet_memory.directory import Directory
from services.gateway.config import GatewayConfig
from services.gateway.fleet import Fleet
from services.gateway.instances import InstanceState
from services.gateway.lm_body import LMBody
from services.gateway.policies.affinity import AffinityPolicy
from services.gateway.policies.base import EncoderPolicy, LMPolicy, LMRequest, request_key
from services.gateway.policies.cache import CachePolicy
from services.gateway.policies.factory import ENCODER_POLICIES, LM_POLICIES, allowed, encoder_policy, lm_policy
from services.gateway.policies.held import HeldPolicy
from services.gateway.policies.load import LoadPolicy
from services.gateway.routing import pick_encoder

pytestmark = pytest.mark.unit

ROOT = pathlib.Path(__file__).resolve().parents[2]
ONE_LM = "127.0.0.1:1"
CFG = GatewayConfig(lms=ONE_LM, affinity_spill=4, held_spill=16, lm_spill=2)
KEYS = [f"{i:064x}" for i in range(200)]


def insts(*spec: tuple[str, int]) -> list[SimpleNamespace]:
    return [SimpleNamespace(address=a, outstanding=n) for a, n in spec]


def decisions(metric: str, decision: str) -> float:
    return REGISTRY.get_sample_value(f"{metric}_total", {"decision": decision}) or 0.0


# --- the factory -------------------------------------------------------------------------------------------------


def test_the_factory_maps_every_encoder_routing_name_to_its_policy():
    classes = {name: type(encoder_policy(name, CFG, Directory())) for name in ENCODER_POLICIES}
    assert classes == {"held": HeldPolicy, "affinity": AffinityPolicy}
    assert all(issubclass(c, EncoderPolicy) for c in classes.values())


def test_the_factory_maps_every_lm_routing_name_to_its_policy():
    classes = {name: type(lm_policy(name, CFG, Directory())) for name in LM_POLICIES}
    assert classes == {"cache": CachePolicy, "load": LoadPolicy}
    assert all(issubclass(c, LMPolicy) for c in classes.values())


def test_the_config_defaults_are_the_first_name_of_each_table():
    cfg = GatewayConfig(lms=ONE_LM)
    assert (cfg.encoder_routing, cfg.lm_routing) == (list(ENCODER_POLICIES)[0], list(LM_POLICIES)[0])


@pytest.mark.parametrize("make, field, listed", [
    (encoder_policy, "encoder_routing", "held or affinity"),
    (lm_policy, "lm_routing", "cache or load"),
])
def test_an_unknown_name_is_refused_with_the_allowed_list(make, field, listed):
    with pytest.raises(ValueError, match=f"{field} must be {listed}, got 'nearest'"):
        make("nearest", CFG, Directory())
    with pytest.raises(ValueError, match=f"{field} must be {listed}, got 'nearest'"):
        GatewayConfig(lms=ONE_LM, **{field: "nearest"})


def test_the_allowed_list_is_read_from_the_table():
    assert allowed({"a": ("m", "A")}) == "a"
    assert allowed({"a": ("m", "A"), "b": ("m", "B"), "c": ("m", "C")}) == "a, b or c"


def test_naming_the_tables_imports_no_policy():
    """``config`` validates against the tables: a policy module is imported only once it is chosen."""
    import subprocess
    import sys
    code = ("import sys, services.gateway.config; "
            "print(sorted(m for m in sys.modules if m.startswith('services.gateway.policies.')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "['services.gateway.policies.factory']"


def test_the_fleet_never_compares_a_policy_name():
    tree = ast.parse((ROOT / "services" / "gateway" / "fleet.py").read_text())
    names = set(ENCODER_POLICIES) | set(LM_POLICIES)
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            parts = [node.left, *node.comparators]
            assert not any(isinstance(p, ast.Constant) and p.value in names for p in parts), ast.unparse(node)
            assert not any(isinstance(p, ast.Attribute) and p.attr in ("encoder_routing", "lm_routing")
                           for p in parts), ast.unparse(node)


# --- encoder policies --------------------------------------------------------------------------------------------


def test_held_sends_an_item_to_the_encoder_that_holds_it_and_remembers_what_it_sent():
    directory = Directory()
    policy = HeldPolicy(CFG, directory)
    cands = insts(("10.0.0.1:1", 0), ("10.0.0.2:1", 0), ("10.0.0.3:1", 0))
    key = KEYS[0]
    affine = pick_encoder(key, cands, spill=4)
    holder = next(c for c in cands if c is not affine)
    holder.outstanding = 3
    assert policy.watches
    assert policy.pick(key, cands) is affine  # nobody holds it yet: affinity
    before = decisions("epd_gateway_encoder_routing", "held")
    policy.sent(holder, [key])
    assert directory.held(holder.address, [key]) == 1
    assert policy.pick(key, cands) is holder  # within --held-spill of the least busy
    assert decisions("epd_gateway_encoder_routing", "held") == before + 1
    holder.outstanding = 17  # past --held-spill (16): affinity again
    assert policy.pick(key, cands) is affine
    assert policy.pick(key, []) is None


def test_affinity_ignores_what_encoders_hold_and_remembers_nothing():
    directory = Directory()
    policy = AffinityPolicy(CFG, directory)
    cands = insts(("10.0.0.1:1", 0), ("10.0.0.2:1", 0), ("10.0.0.3:1", 0))
    key = KEYS[1]
    affine = pick_encoder(key, cands, spill=4)
    other = next(c for c in cands if c is not affine)
    directory.sent(other.address, [key])  # held there, but affinity does not look
    policy.sent(affine, [KEYS[2]])
    assert not policy.watches
    assert policy.pick(key, cands) is affine
    assert directory.held(affine.address, [KEYS[2]]) == 0
    affine.outstanding = 5  # more than --affinity-spill (4) beyond the least busy: spills
    assert policy.pick(key, cands).outstanding == 0


# --- LM policies -------------------------------------------------------------------------------------------------


def test_load_picks_the_least_busy_lm_whatever_it_holds():
    directory = Directory()
    policy = LoadPolicy(CFG, directory)
    a, b, c = cands = insts(("a:1", 2), ("b:1", 0), ("c:1", 1))
    directory.sent(a.address, ["img"])
    before = decisions("epd_gateway_lm_routing", "load")
    assert policy.pick(cands, LMRequest(["img"], prefix.NONE, "k")) is b
    assert decisions("epd_gateway_lm_routing", "load") == before  # load routing counts no decision
    policy.answered(c, ["img2"], "p:x")
    assert directory.held(c.address, ["img2"]) == 0 and not policy.watches
    assert policy.prefix(LMBody("chat", {"messages": [{"role": "user", "content": "x" * 400}]})) is prefix.NONE
    assert policy.pick([], LMRequest()) is None


@pytest.mark.parametrize("outstanding, want, decision", [
    ((0, 0, 0), "b:1", "held"),  # b holds the image
    ((0, 2, 0), "b:1", "held"),  # two calls busier: within --lm-spill (2)
    ((0, 3, 1), "a:1", "spill"),  # three: the least busy wins
])
def test_cache_prefers_the_lm_that_holds_the_prompt_within_the_spill_bound(outstanding, want, decision):
    directory = Directory()
    policy = CachePolicy(CFG, directory)
    cands = insts(*zip(("a:1", "b:1", "c:1"), outstanding))
    policy.answered(cands[1], ["img"])
    before = decisions("epd_gateway_lm_routing", decision)
    assert policy.watches
    assert policy.pick(cands, LMRequest(["img"], prefix.NONE, "img")).address == want
    assert decisions("epd_gateway_lm_routing", decision) == before + 1


def test_cache_routes_a_request_with_nothing_to_score_by_load_and_counts_nothing():
    policy = CachePolicy(CFG, Directory())
    cands = insts(("a:1", 1), ("b:1", 0))
    before = decisions("epd_gateway_lm_routing", "load")
    assert policy.pick(cands, LMRequest([], prefix.NONE, "b:digest")) is cands[1]
    assert decisions("epd_gateway_lm_routing", "load") == before


def test_cache_keys_a_generating_requests_prefix_and_nothing_else():
    policy = CachePolicy(CFG, Directory())
    messages = [{"role": "user", "content": "tell me about routing " * 20}]
    keys = policy.prefix(LMBody("chat", {"messages": messages}))
    assert keys.keys and keys.last.startswith(prefix.KEY_PREFIX)
    assert policy.prefix(LMBody("tokenize", {"messages": messages})) is prefix.NONE  # generates nothing
    assert policy.prefix(None) is prefix.NONE


# --- the request's key, and two replicas ------------------------------------------------------------------------


def test_the_routing_key_is_the_prefix_then_the_media_then_the_text():
    keys = prefix.Prefix(("p:1", "p:2"), (40, 80), (0, 0))
    assert request_key(["i1"], keys, {"x": 1}) == "p:2"
    assert request_key(["i1", "i2"], prefix.NONE, {"x": 1}) == "i1,i2"
    text = request_key([], prefix.NONE, {"a": 1, "b": [2]})
    assert text == request_key([], prefix.NONE, {"b": [2], "a": 1}) != request_key([], prefix.NONE, {"a": 2})
    raw = request_key([], prefix.NONE, b"raw")
    assert raw == request_key([], prefix.NONE, b"raw") != request_key([], prefix.NONE, b"other") and raw != text
    assert request_key([], prefix.NONE, None) == ""


LMS = [f"10.0.0.{i // 2}:{50050 + i}" for i in range(6)]  # two to a host: a prefill LM has a decode LM beside it
ENCODERS = [f"10.1.0.{i}:6000" for i in range(4)]
ROLES = ["both", "both", "prefill", "decode", "prefill", "decode"]


def _view(fleet: Fleet, rng: random.Random) -> None:
    """One random view of the fleet: every instance admitted, with its role and outstanding calls."""
    for inst, role in zip(fleet.lms.instances.values(), ROLES, strict=True):
        inst.state, inst.lm_role, inst.outstanding = InstanceState.ADMITTED, role, rng.randrange(3)
    for inst in fleet.encoders.instances.values():
        inst.state, inst.outstanding = InstanceState.ADMITTED, rng.randrange(3)


def _picks(fleet: Fleet, seed: int) -> list[tuple]:
    """What ``fleet`` picks for 200 requests, each on its own view (drawn from ``seed``), held things fed
    in as the orchestrator does."""
    rng, out = random.Random(seed), []
    for n in range(200):
        _view(fleet, rng)
        items = [KEYS[rng.randrange(20)] for _ in range(rng.randrange(3))]
        body = LMBody("chat", {"messages": [{"role": "user", "content": f"question {rng.randrange(8)} " * 30}]})
        keys = fleet.prefix_of(body) if n % 2 else prefix.NONE
        key = fleet.request_key(items, keys, body)
        encoders = [fleet.pick_encoder(i, fleet.encoders.healthy(set())) for i in items]
        for enc, item in zip(encoders, items):
            fleet.encoded(enc, [item])
        lm, decode = fleet.pick_lms(set(), disaggregate=bool(n % 3), items=items, keys=keys, key=key)
        fleet.answered(lm, items, keys.last)
        out.append(([e.address for e in encoders], lm.address, decode.address if decode else None))
    return out


@pytest.mark.parametrize("encoder_routing", list(ENCODER_POLICIES))
@pytest.mark.parametrize("lm_routing", list(LM_POLICIES))
def test_two_gateway_replicas_with_the_same_view_route_every_request_the_same_way(encoder_routing, lm_routing):
    """Two independent fleets (two gateway processes), the same instances, loads and held things, the same
    requests: the same encoder for every item, the same LM and decode LM, ties included."""
    async def go():
        cfg = GatewayConfig(lms=",".join(LMS), encoders=",".join(ENCODERS), encoder_routing=encoder_routing,
                            lm_routing=lm_routing)
        one, two = Fleet(cfg), Fleet(cfg)
        try:
            first = _picks(one, seed=7)
            assert first == _picks(two, seed=7)
            assert any(d for _, _, d in first) and any(not d for _, _, d in first)  # pairs and single LMs
        finally:
            for pool in one.pools() + two.pools():
                await pool.close()

    asyncio.run(go())


def test_equally_idle_lms_take_different_requests_but_always_the_same_lm_for_the_same_request():
    """The tie-break hashes the request's key: no process-local turn, and still no single hot LM."""
    async def go():
        fleet = Fleet(GatewayConfig(lms=",".join(LMS[:2] + LMS[2:4]), lm_routing="load"))
        try:
            for inst in fleet.lms.instances.values():
                inst.state, inst.lm_role = InstanceState.ADMITTED, "both"
            def pick(text: str) -> str:
                body = LMBody("chat", {"messages": [{"role": "user", "content": text}]})
                return fleet.pick_lms(set(), key=fleet.request_key([], prefix.NONE, body))[0].address
            assert len({pick("hi") for _ in range(10)}) == 1
            assert len({pick(f"hi {n}") for n in range(40)}) == 4
        finally:
            await fleet.lms.close()

    asyncio.run(go())
