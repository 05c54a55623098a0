"""Issue 33: the fleet's memory, alone (services/fleet_memory): an LM's holdings from vLLM's KV cache
events, the gateway's directory and its consistency rule, and the LM scoring (load wins past a bound)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import pytest

from services.fleet_memory.directory import Directory
from services.fleet_memory.holdings import EventListener, Holdings
from services.fleet_memory.prefix import CHUNK_CHARS, ITEM_TOKENS, NONE, feed, of_request
from services.fleet_memory.scoring import pick_lm, score
from services.gateway.routing import LeastOutstanding

pytestmark = pytest.mark.unit

vllm_events = pytest.importorskip("vllm.distributed.kv_events")


def stored(blocks, keys):
    return vllm_events.BlockStored(block_hashes=blocks, parent_block_hash=None, token_ids=[1] * (4 * len(blocks)),
                                   block_size=4, lora_id=None, medium="GPU", lora_name=None, extra_keys=keys)


def removed(blocks):
    return vllm_events.BlockRemoved(block_hashes=blocks, medium="GPU")


def test_an_item_is_held_while_any_of_its_blocks_is_cached():
    h = Holdings()
    # Block 1: text only; blocks 2-3: image A's tokens (offsets); block 4: A's end and B's start; a salt.
    h.apply(stored([1, 2, 3, 4], [None, (("A", 0),), (("A", 4),), (("A", 8), ("B", 0), "salt")]))
    assert set(h.snapshot()[2]) == {"A", "B"}
    h.apply(removed([2, 3]))
    assert "A" in h and "B" in h  # block 4 still holds part of both
    h.apply(removed([4, 99]))  # a block it never saw is no error
    assert h.snapshot()[2] == []
    h.apply(stored([5], [(("C", 0),)]))
    h.apply(vllm_events.AllBlocksCleared())
    assert h.snapshot()[2] == []


def test_holdings_are_bounded_and_every_change_moves_the_generation():
    h = Holdings(max_items=3, max_blocks=4)
    epoch, g0, _ = h.snapshot()
    for i in range(6):
        h.apply(stored([i], [((f"item{i}", 0),)]))
    epoch1, g1, items = h.snapshot()
    assert epoch1 == epoch and g1 > g0
    assert len(items) <= 3 and items[-1] == "item5"  # the most recent kept
    h.apply(stored([1], [(("again", 0),)]))  # an evicted block's hash stored again is a new block
    assert "again" in h


def test_a_gap_in_the_publishers_sequence_starts_a_new_epoch():
    h = Holdings()
    listener = EventListener("ipc:///nonexistent", h)
    listener.handle(7, [stored([1], [(("A", 0),)])])
    epoch = h.snapshot()[0]
    listener.handle(8, [stored([2], [(("B", 0),)])])
    assert h.snapshot()[0] == epoch and set(h.snapshot()[2]) == {"A", "B"}
    listener.handle(11, [stored([3], [(("C", 0),)])])  # 9 and 10 lost: what they said is unknown
    new_epoch, generation, items = h.snapshot()
    assert new_epoch != epoch and items == ["C"]


def test_the_directory_takes_the_lms_snapshot_as_the_truth():
    d = Directory()
    d.update("lm1", "e1", 3, ["A", "B"], asked_at=10.0)
    assert d.held("lm1", ["A", "X"]) == 1 and d.known("lm1") == ("e1", 3)
    d.sent("lm1", ["C"], now=11.0)  # answered after the ask: held until a later snapshot says
    assert d.held("lm1", ["C"]) == 1
    d.update("lm1", "e1", 3, None, asked_at=10.5)  # an answer to an ask made before C was sent
    assert d.held("lm1", ["C"]) == 1
    d.update("lm1", "e1", 4, ["A"], asked_at=12.0)  # asked 1 s after C was sent: C may not be stored yet
    assert d.held("lm1", ["A", "B", "C"]) == 2
    d.update("lm1", "e1", 4, None, asked_at=11.0 + d.settle_s + 0.1)  # long enough after: C never stored
    assert d.held("lm1", ["A", "B", "C"]) == 1
    d.update("lm1", "e2", 0, [], asked_at=13.0)  # restarted: a new epoch, nothing held
    assert d.held("lm1", ["A"]) == 0
    d.forget("lm1")
    assert d.known("lm1") == ("", -1) and d.held("lm1", ["A"]) == 0


def test_the_directory_is_bounded():
    d = Directory(max_items=2, max_lms=2)
    d.update("lm1", "e", 1, ["A", "B", "C"])
    assert d.held("lm1", ["A", "B", "C"]) == 2  # the most recent two
    d.sent("lm2", ["X", "Y", "Z"])
    assert d.held("lm2", ["X", "Y", "Z"]) == 2
    d.update("lm3", "e", 1, ["A"])
    assert d.addresses() == ["lm1", "lm2"]


@dataclass
class LM:
    address: str
    outstanding: int = 0


def test_the_lm_that_holds_the_items_wins_until_load_does():
    d, policy = Directory(), LeastOutstanding()
    a, b, c = LM("a"), LM("b"), LM("c")
    d.update("b", "e", 1, ["img1", "img2"])
    d.update("c", "e", 1, ["img1"])
    assert pick_lm(["img1", "img2"], [a, b, c], d, policy, spill=2) == (b, "held")
    assert pick_lm(["img1"], [a, b, c], d, policy, spill=2)[0] in (b, c)  # a tie between holders
    b.outstanding = 3  # 3 beyond the least busy: more than the spill
    assert pick_lm(["img1", "img2"], [a, b, c], d, policy, spill=2) == (a, "spill")
    b.outstanding = 2
    assert pick_lm(["img1", "img2"], [a, b, c], d, policy, spill=2) == (b, "held")
    assert pick_lm(["other"], [a, b, c], d, policy, spill=2) in ((a, "load"), (c, "load"))  # the idle ones
    assert pick_lm([], [a], d, policy, spill=2) == (a, "load")
    assert pick_lm(["img1"], [], d, policy, spill=2) == (None, "load")


def test_the_lm_answers_holdings_only_when_they_changed():
    import asyncio
    from types import SimpleNamespace

    from epd.transfer.v1 import transfer_pb2
    from services.lm.servicer import LMServicer

    h = Holdings()
    h.apply(stored([1], [(("A", 0),)]))
    me = SimpleNamespace(holdings=h)
    first = asyncio.run(LMServicer.Holdings(me, transfer_pb2.HoldingsRequest(generation=-1), None))
    assert first.changed and list(first.items) == ["A"]
    again = asyncio.run(LMServicer.Holdings(me, transfer_pb2.HoldingsRequest(epoch=first.epoch, generation=first.generation),
                                            None))
    assert not again.changed and not again.items
    off = asyncio.run(LMServicer.Holdings(SimpleNamespace(holdings=None), transfer_pb2.HoldingsRequest(), None))
    assert off.epoch == "off" and off.changed and not off.items


def test_the_encoder_store_answers_holdings_only_when_they_changed():
    """The encoder's Transfer server answers what its outbound store holds or keeps (the encoder service
    passes it on as EncoderService.Holdings): the items, then nothing until they change."""
    import asyncio

    import torch

    from ectransfer.outbound import OutboundStore
    from ectransfer.pool import Pool
    from ectransfer.server import TransferServicer
    from epd.transfer.v1 import transfer_pb2

    store = OutboundStore(Pool(1 << 16), keep_bytes=1 << 12)
    servicer = TransferServicer(store, transfer_pb2.CompatInfo(), "enc-1", {})
    store.put("A", torch.zeros(4, 8), ("c",))
    first = asyncio.run(servicer.Holdings(transfer_pb2.HoldingsRequest(generation=-1), None))
    assert first.changed and list(first.items) == ["A"] and first.epoch.startswith("enc-1-")
    store.ack("A", "c")  # kept in the host tier: still held
    again = asyncio.run(servicer.Holdings(transfer_pb2.HoldingsRequest(epoch=first.epoch,
                                                                       generation=first.generation), None))
    assert not again.changed and not again.items
    store.clear_tier()
    gone = asyncio.run(servicer.Holdings(transfer_pb2.HoldingsRequest(epoch=first.epoch,
                                                                      generation=first.generation), None))
    assert gone.changed and not gone.items


# -- prefix keys: text the directory routes by (services/fleet_memory/prefix.py) -----------------------------

def chat(*texts, **fields):
    return {"model": "m", "messages": [{"role": "user" if i % 2 == 0 else "assistant", "content": t}
                                       for i, t in enumerate(texts)], **fields}


def test_a_follow_up_turns_keys_start_with_every_key_of_the_turn_before():
    first = of_request("chat", chat("hello " * 50), {})
    follow = of_request("chat", chat("hello " * 50, "an answer", "and then?"), {})
    assert len(first.keys) == 1 and len(follow.keys) == 3
    assert follow.keys[:1] == first.keys and first.last.startswith("p:")
    assert follow.tokens[0] == first.tokens[0] >= len("hello " * 50) // 4 and follow.tokens[2] > follow.tokens[1]
    # What shapes the prompt before its first message is in every key: another tenant's salt, another model.
    assert of_request("chat", chat("hello " * 50), {}, salt="t2:").keys[0] != first.keys[0]
    assert of_request("chat", chat("hello " * 50, tools=[{"type": "function"}]), {}).keys[0] != first.keys[0]
    assert of_request("chat", {"model": "m", "messages": "not a list"}, {}) == NONE
    assert of_request("chat", ["not", "a", "dict"], {}) == NONE
    assert of_request("chat", chat("describe"), {}) == NONE  # too short to hold a whole block: routed by load
    assert len(of_request("chat", chat("hi", "hello", "Tell me about the sea. " * 10), {}).keys) == 1


def test_a_media_part_is_keyed_by_its_content_hash_however_it_was_sent():
    def body(url):
        return {"messages": [{"role": "user", "content": [{"type": "text", "text": "what is it?"},
                                                          {"type": "image_url", "image_url": {"url": url}}]}]}
    at = {("messages", 0, "content", 1): "abc123"}
    by_url, by_data = of_request("chat", body("http://x/cat.png"), at), of_request("chat", body("data:..."), at)
    assert by_url.keys == by_data.keys and by_url.items == (1,) and by_url.tokens[0] >= ITEM_TOKENS
    assert of_request("chat", body("http://x/cat.png"), {("messages", 0, "content", 1): "def456"}).keys != by_url.keys


def test_a_completions_prompt_is_keyed_by_whole_chunks():
    text = "x" * (2 * CHUNK_CHARS + 10)
    p = of_request("completions", {"prompt": text}, {})
    assert len(p.keys) == 2  # the partial last chunk has none: the next turn's prompt goes on from it
    assert of_request("completions", {"prompt": text + "more" * 200}, {}).keys[:2] == p.keys
    assert len(of_request("completions", {"prompt": list(range(CHUNK_CHARS))}, {}).keys) == 4
    assert of_request("completions", {"prompt": ["a batch", "of two"]}, {}) == NONE
    assert of_request("responses", {"input": "hi " * 300}, {}).keys  # a Responses input string is one message


def test_a_prefix_key_is_held_while_a_block_stored_under_it_is():
    h = Holdings()
    ev = stored([1, 2], None)
    ev.session_id = "p:conv1"
    h.apply(ev)
    h.stored([3], None, session="a client's own id")  # not a prefix key: never held
    h.stored([4], None, session="p:" + "x" * 80)  # too long
    assert h.snapshot()[2] == ["p:conv1"]
    h.apply(removed([1]))
    assert "p:conv1" in h
    h.apply(removed([2]))
    assert "p:conv1" not in h


def test_the_lm_holding_the_longest_prefix_wins_and_images_after_it_count_too():
    d, policy = Directory(), LeastOutstanding()
    a, b, c = LM("a"), LM("b"), LM("c")
    conv = of_request("chat", chat("a long system prompt " * 40, "answer", "follow-up"), {})
    d.update("b", "e", 1, [conv.keys[0]])  # b served the first turn
    d.update("c", "e", 1, ["img9"])  # c holds an image the follow-up sends after its history
    assert score("b", [], conv, d) == conv.tokens[0] and score("a", [], conv, d) == 0
    assert pick_lm([], [a, b, c], d, policy, spill=2, prefix=conv) == (b, "held")
    assert pick_lm(["img9"], [a, c], d, policy, spill=2, prefix=conv) == (c, "held")
    assert score("c", ["img9"], conv, d) == ITEM_TOKENS
    b.outstanding = 3
    assert pick_lm([], [a, b], d, policy, spill=2, prefix=conv) == (a, "spill")
    d.sent("a", [conv.last])  # a answered the whole conversation: it holds more of it than b
    assert pick_lm([], [a, b], d, policy, spill=5, prefix=conv) == (a, "held")


def _fed(value) -> str:
    h = hashlib.sha256()
    feed(h, value)
    return h.hexdigest()


def test_a_prefix_digest_tells_every_json_value_apart_and_ignores_key_order():
    values = ["1", 1, 1.0, True, None, "", [], {}, ["ab", "c"], ["a", "bc"], {"a": "b"}, ["a", "b"],
              {"a": 1, "b": [2]}, "é", "\ud800"]
    assert len({_fed(v) for v in values}) == len(values)
    assert _fed({"a": 1, "b": [2]}) == _fed({"b": [2], "a": 1})
    big = "x" * (4 << 20)  # a text of megabytes is hashed as its bytes, once
    assert _fed({"text": big}) == _fed({"text": "x" * (4 << 20)}) != _fed({"text": big + "x"})
