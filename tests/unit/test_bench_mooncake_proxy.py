"""bench/mooncake_proxy.py: the bodies it builds for vLLM's ECMooncakeConnector choreography (upstream's
E + PD proxy): what the encoder is asked, how its answer is matched to the request's items, and what the
consumer then gets (no servers: the system itself runs in bench/probe_ec_mooncake.py --system)."""

from __future__ import annotations

import copy

import pytest

from tests.unit.helpers import load_bench

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def proxy():
    return load_bench("mooncake_proxy")


def _image(n: int) -> dict:
    return {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{n}"}}


def _body(*images: dict) -> dict:
    return {"model": "m", "stream": True, "max_tokens": 8, "mm_processor_kwargs": {"k": 1},
            "messages": [{"role": "system", "content": "be brief"},
                         {"role": "user", "content": [images[0], {"type": "text", "text": "and"}, *images[1:]]}]}


def test_the_encoder_gets_every_item_without_text_with_content_uuids_and_one_transfer_id_each(proxy):
    body = _body(_image(1), _image(2))
    req = proxy.encoder_request(body, proxy.media_items(body), "tcp://h:9", ["t1", "t2"], rewrite=True)
    content = req["messages"][0]["content"]
    assert [c["type"] for c in content] == ["image_url", "image_url"]
    assert [c["uuid"] for c in content] == [proxy.content_uuid(_image(1)), proxy.content_uuid(_image(2))]
    assert req["ec_transfer_params"] == {"consumer_zmq": "tcp://h:9", "ec_items": [{"transfer_id": "t1"},
                                                                                  {"transfer_id": "t2"}]}
    assert req["stream"] is False and "max_tokens" not in req  # an encode-only server never samples
    assert req["mm_processor_kwargs"] == {"k": 1}
    plain = proxy.encoder_request(body, proxy.media_items(body), "tcp://h:9", ["t1", "t2"], rewrite=False)
    assert all("uuid" not in c for c in plain["messages"][0]["content"])  # the consumer hashes them alike


def test_the_uuid_is_the_content_so_a_repeated_image_keeps_its_key(proxy):
    assert proxy.content_uuid(_image(1)) == proxy.content_uuid(copy.deepcopy(_image(1)))
    assert proxy.content_uuid(_image(1)) != proxy.content_uuid(_image(2))


def test_items_are_matched_by_the_encoders_item_indices_else_by_uuid(proxy):
    items = [_image(1), _image(2)]
    params = {"h2": {"item_indices": [1], "metadata": {"image_grid_thw": [[1, 4, 4]]}},
              "h1": {"item_indices": [0], "metadata": {}}}
    meta = proxy.match_encoder_params(params, items, ["t1", "t2"], rewrite=True)
    assert meta[0] == {"mm_hash": proxy.content_uuid(items[0]), "ec_mm_hash": "h1", "transfer_id": "t1"}
    assert meta[1]["ec_mm_hash"] == "h2" and meta[1]["image_grid_thw"] == [[1, 4, 4]]
    one = proxy.match_encoder_params({"h": {"metadata": {}}}, items[:1], ["t"], rewrite=False)
    assert one[0] == {"mm_hash": "h", "ec_mm_hash": "h", "transfer_id": "t"}
    with pytest.raises(ValueError):
        proxy.match_encoder_params({"h1": {"item_indices": [0]}, "h2": {"item_indices": [0]}}, items, ["a", "b"], True)


def test_rewriting_turns_items_with_metadata_into_embeds_and_names_only_them(proxy):
    body = _body(_image(1), _image(2))
    original = copy.deepcopy(body)
    meta = {0: {"image_grid_thw": [[1, 4, 4]], "mm_hash": "u1", "ec_mm_hash": "h1", "transfer_id": "t1"},
            1: {"mm_hash": "u2", "ec_mm_hash": "h2", "transfer_id": "t2"}}
    out = proxy.consumer_body(body, meta, {"h1": {"x": 1}}, rewrite=True)
    content = out["messages"][1]["content"]
    assert content[0] == {"type": "image_embeds", "image_embeds": {"image_grid_thw": [1, 4, 4]}, "uuid": "u1"}
    assert content[1] == {"type": "text", "text": "and"} and content[2] == _image(2)  # no metadata: sent as is
    assert out["ec_transfer_params"] == {"h1": {"x": 1}, "ec_items": [{"mm_hash": "h1", "transfer_id": "t1"}]}
    assert body == original  # a retry starts from the original media


def test_without_rewriting_the_images_stay_and_every_item_is_named_by_its_transfer_id(proxy):
    body = _body(_image(1), _image(2))
    meta = {0: {"mm_hash": "h1", "ec_mm_hash": "h1", "transfer_id": "t1"},
            1: {"mm_hash": "h2", "ec_mm_hash": "h2", "transfer_id": "t2"}}
    out = proxy.consumer_body(body, meta, {}, rewrite=False)
    assert out["messages"] == body["messages"]
    assert out["ec_transfer_params"]["ec_items"] == [{"mm_hash": "h1", "transfer_id": "t1"},
                                                     {"mm_hash": "h2", "transfer_id": "t2"}]
    text = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    assert proxy.media_items(text) == [] and proxy.consumer_body(text, {}, {}, rewrite=False) == text
