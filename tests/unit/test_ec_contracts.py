"""The dicts vLLM carries between the services and the connector halves, read and
written only through their dataclasses (``ectransfer.connector.metadata``)."""

from __future__ import annotations

import pytest

from ectransfer.connector.metadata import (
    ConsumerFinished,
    ECTransferParams,
    FinishedItem,
    ItemSource,
    ProducerFinished,
    TransferReport,
)

pytestmark = pytest.mark.unit

WIRE_PARAMS = {"items": {"img-a": {"endpoint": "enc-1:5000", "embed_width": 128, "dtype": "bfloat16"},
                         "img-b": {"endpoint": "enc-2:5000", "embed_width": 64, "dtype": "float16"}}}


def test_ec_transfer_params_round_trip_through_the_dict_vllm_carries():
    params = ECTransferParams.from_dict(WIRE_PARAMS)
    assert params.items["img-a"] == ItemSource("enc-1:5000", 128, "bfloat16")
    assert params.to_dict() == WIRE_PARAMS
    assert params.endpoints() == ["enc-1:5000", "enc-2:5000"]


def test_no_ec_transfer_params_means_no_items():
    assert ECTransferParams.from_dict(None).items == {}
    assert ECTransferParams.from_dict({}).items == {}


@pytest.mark.parametrize("bad, says", [
    ([], "mapping"),
    ({"items": {}, "endpoint": "evil:1"}, "unknown keys ['endpoint']"),
    ({"items": ["enc-1:5000"]}, "mapping"),
    ({"items": {"a": "enc-1:5000"}}, "mapping"),
    ({"items": {"a": {"endpoint": "enc-1:5000", "embed_width": 128}}}, "missing keys ['dtype']"),
    ({"items": {"a": {"endpoint": "", "embed_width": 128, "dtype": "bfloat16"}}}, "endpoint"),
    ({"items": {"a": {"endpoint": 5000, "embed_width": 128, "dtype": "bfloat16"}}}, "endpoint"),
    ({"items": {"a": {"endpoint": "e:1", "embed_width": "128", "dtype": "bfloat16"}}}, "embed_width"),
    ({"items": {"a": {"endpoint": "e:1", "embed_width": 0, "dtype": "bfloat16"}}}, "embed_width"),
    ({"items": {"a": {"endpoint": "e:1", "embed_width": True, "dtype": "bfloat16"}}}, "embed_width"),
    ({"items": {"a": {"endpoint": "e:1", "embed_width": 128, "dtype": "complex64"}}}, "unsupported dtype"),
    ({"items": {"a": {"endpoint": "e:1", "embed_width": 128, "dtype": "bfloat16", "port": 1}}}, "unknown keys"),
    ({"items": {"": {"endpoint": "e:1", "embed_width": 128, "dtype": "bfloat16"}}}, "identifier"),
])
def test_malformed_ec_transfer_params_are_refused_with_what_is_wrong(bad, says):
    with pytest.raises(ValueError) as e:
        ECTransferParams.from_dict(bad)
    assert says in str(e.value)


def test_an_item_source_is_checked_however_it_is_built():
    with pytest.raises(ValueError, match="embed_width"):
        ItemSource("enc-1:5000", -1, "bfloat16")


def test_consumer_finished_leaves_out_what_is_empty():
    assert ConsumerFinished().to_dict() == {}
    assert ConsumerFinished.from_dict(None) == ConsumerFinished()
    failed = ConsumerFinished("the encoder went away", ("enc-2:1", "enc-1:1"))
    assert failed.to_dict() == {"error": "the encoder went away", "failed_endpoints": ["enc-2:1", "enc-1:1"]}
    assert ConsumerFinished.from_dict(failed.to_dict()) == failed


def test_consumer_finished_round_trips_its_report():
    info = ConsumerFinished(report=TransferReport(0, 2, 3.5, {"enc-1:1": "SHM"}))
    wire = info.to_dict()
    assert wire == {"local_encoder_runs": 0, "transferred_items": 2, "transfer_ms": 3.5,
                    "transports": {"enc-1:1": "SHM"}}
    assert ConsumerFinished.from_dict(wire) == info
    local_only = ConsumerFinished(report=TransferReport(1, 0, 0.0)).to_dict()
    assert "transports" not in local_only and local_only["local_encoder_runs"] == 1


@pytest.mark.parametrize("bad", [{"error": 1}, {"failed_endpoints": "enc-1:1"}, {"transferred_items": -1},
                                 {"transfer_ms": "fast"}, {"transports": {"enc-1:1": 3}}, {"other": 1}])
def test_malformed_consumer_finished_info_is_refused(bad):
    with pytest.raises(ValueError):
        ConsumerFinished.from_dict(bad)


def test_producer_finished_round_trips():
    info = ProducerFinished({"img-a": FinishedItem(16, "image")}, encoder_runs=1)
    assert info.to_dict() == {"items": {"img-a": {"num_embeds": 16, "modality": "image"}}, "encoder_runs": 1}
    assert ProducerFinished.from_dict(info.to_dict()) == info
    assert ProducerFinished.from_dict(None).encoder_runs == 0
    with pytest.raises(ValueError, match="encoder_runs"):
        ProducerFinished.from_dict({"items": {}, "encoder_runs": "2"})
