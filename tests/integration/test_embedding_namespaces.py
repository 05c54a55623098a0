"""Each tenant's embeddings in its own namespace, through the whole gateway (``server.serve`` with client
keys, two fake encoders that name items as the real encoder does, a fake LM): the same image sent by two
tenants is two items (two identifiers, each encoded, neither served from the other's), a tenant's second
send is the same item (same identifier, same encoder by affinity: its cached embedding), and a gateway
without keys names items by the SHA-256 of their bytes, as it always did."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json

import pytest

from services.common.media import content_id
from tests.integration.gateway_fakes import FakeEncoder, FakeLM, World, serve_fake
from tests.integration.gateway_harness import Gateway
from tests.integration.test_gateway_auth import KEY_A, KEY_B, rest, write_keys
from tests.integration.test_gateway_start_order import run
from tools.media import data_url, make_image

pytestmark = pytest.mark.integration

IMAGE = make_image(21, (32, 32))


def image_chat() -> dict:
    return {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(IMAGE)}},
                                                      {"type": "text", "text": "what is this?"}]}],
            "max_tokens": 3}


@contextlib.asynccontextmanager
async def deployment(**cfg):
    """A gateway (``cfg``) over two fake encoders that name items as the real one does and a fake LM, all
    admitted: yields (gateway, encoders, lm)."""
    world = World()
    encoders = [FakeEncoder(f"enc-{c}", world, wait_lm_s=0.0) for c in "AB"]
    for e in encoders:
        e.names_items = True
    lm = FakeLM("lm-X", world)
    served = [await serve_fake(f) for f in (*encoders, lm)]
    try:
        async with Gateway(encoders=",".join(a for _, a in served[:2]), lms=served[2][1], placement="encoder",
                           **cfg) as gw:
            await gw.poll(lambda: gw.get("/health"), lambda r: r[0] == 200 and len(r[1].get("encoders", {})) == 2
                          and all(r[1]["encoders"].values()), 20, "the encoders and the LM are admitted")
            yield gw, encoders, lm
    finally:
        await asyncio.gather(*(s.stop(0) for s, _ in served))


def encodes(encoders: list[FakeEncoder], lm: FakeLM) -> list[tuple[str, str, bool]]:
    """Per LM request, in order: (the encoder of its one item, the Encode call's namespace, whether that
    encoder had encoded the item's identifier before)."""
    out = []
    for r in lm.requests:
        (enc, n), = [(e, n) for e in encoders for n, er in enumerate(e.requests) if er.request_id == r.request_id]
        out.append((enc.name, enc.requests[n].namespace, enc.hits[n]))
    return out


def test_two_tenants_sending_one_image_get_two_items_and_a_tenants_second_send_reuses_its_own(tmp_path):
    keys = write_keys(tmp_path / "keys.jsonl", ("a", KEY_A), ("b", KEY_B))
    a_item, b_item = content_id(IMAGE, "a:"), content_id(IMAGE, "b:")

    async def body():
        async with deployment(api_keys_file=keys) as (gw, encoders, lm):
            for key in (KEY_A, KEY_B, KEY_A):
                status, raw = await rest(gw, "POST", "/v1/chat/completions", key, body=image_chat())
                assert status == 200, raw
            # The gateway names each tenant's item in the tenant's namespace, and tells the encoder and the
            # LM which namespace (they compute and check identifiers in it).
            assert [(r.namespace, r.items[0].identifier) for r in lm.requests] == \
                [("a:", a_item), ("b:", b_item), ("a:", a_item)]
            assert len({a_item, b_item, hashlib.sha256(IMAGE).hexdigest()}) == 3
            for r in lm.requests:  # the item's uuid in the LM's body is the same identifier
                parts = json.loads(r.openai.body)["messages"][0]["content"]
                assert [p["uuid"] for p in parts if p.get("type") == "image_url"] == [r.items[0].identifier]
            (enc_a1, ns_a1, hit_a1), (_, ns_b, hit_b), (enc_a2, ns_a2, hit_a2) = encodes(encoders, lm)
            assert (ns_a1, ns_b, ns_a2) == ("a:", "b:", "a:")
            # b's send of a's image is a miss wherever it went; a's second send goes to the encoder that
            # has a's item (affinity by identifier) and is a hit there.
            assert (hit_a1, hit_b, hit_a2) == (False, False, True) and enc_a1 == enc_a2

    run(body)


def test_a_gateway_without_keys_names_items_by_the_sha256_of_their_bytes():
    async def body():
        async with deployment() as (gw, encoders, lm):
            for _ in range(2):
                status, raw = await rest(gw, "POST", "/v1/chat/completions", None, body=image_chat())
                assert status == 200, raw
            assert [(r.namespace, r.items[0].identifier) for r in lm.requests] == \
                [("", hashlib.sha256(IMAGE).hexdigest())] * 2
            assert [hit for _, _, hit in encodes(encoders, lm)] == [False, True]

    run(body)
