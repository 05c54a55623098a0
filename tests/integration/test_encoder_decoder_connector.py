"""Issue 35, the connector's scheduler half for an encoder-decoder model (real gRPC, real shared memory,
no engine; the engines: tests/integration/test_whisper_apart_seam.py). The request is held until its
item (at token 0, as Whisper's audio is) has landed; vLLM is never told the item is external
(``has_cache_item``), so it schedules it as a local input (and sizes its cross-attention blocks), and
the load is queued when vLLM allocates it; it is counted as transferred, not as a local encoder run."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from vllm.multimodal.inputs import PlaceholderRange

from ectransfer.connector.config import ConnectorConfig
from ectransfer.connector.consumer import ConsumerScheduler, ConsumerWorker
from tests.integration.connector_fakes import claim_of, embedding, request, steps_until, vllm_config

pytestmark = pytest.mark.integration

ENGINE = "lm-encoder-decoder"
N = 30  # encoder output rows (Whisper: 1500 per 30 s window)


def _config(encoder_decoder: bool):
    cfg = vllm_config(ENGINE)
    cfg.model_config.is_encoder_decoder = encoder_decoder
    return cfg


@pytest.fixture
def half():
    cfg = ConnectorConfig(staging_bytes=1 << 20, transfer_timeout_s=10.0, model_name="test-model")
    sched = ConsumerScheduler(_config(True), cfg).start()
    yield sched
    sched.shutdown()


def _audio_request(rid: str, ident: str, endpoint: str):
    req = request(rid, [(ident, N)], endpoint)
    req.mm_features[0].modality = "audio"
    req.mm_features[0].mm_position = PlaceholderRange(offset=0, length=N)  # the encoder's input, not the prompt's
    return req


def test_the_item_is_held_then_scheduled_as_local_and_loaded(producer, half):
    sched = half
    req = _audio_request("r1", "clip", producer.endpoint)
    assert not sched.ensure_cache_available(req, 0)  # at token 0: nothing can be computed before it
    assert not sched.ensure_cache_available(req, 0)
    out = embedding(N, 7)
    producer.store.put("clip", out, claims=(claim_of("r1"),))
    assert steps_until(lambda: sched.ensure_cache_available(req, 0))
    assert not sched.has_cache_item("clip")  # vLLM's local path: it allocates the cross-attention blocks

    sched.update_state_after_alloc(req, 0)  # vLLM calls it for every input it allocates
    meta = sched.build_meta(SimpleNamespace(scheduled_encoder_inputs={"r1": [0]}, total_num_scheduled_tokens=4,
                                            num_scheduled_tokens={"r1": 4}))
    assert [spec.identifier for spec in meta.loads] == ["clip"]
    worker = ConsumerWorker(_config(True), sched.cfg)
    cache = {}
    worker.load(cache, meta)  # what the runner hands the decoder (ectransfer.connector.encoder_decoder)
    assert cache["clip"].equal(out)
    sched.update_connector_output(SimpleNamespace(ec_connector_worker_meta=worker.build_worker_meta()))
    worker.shutdown()
    finished = sched.request_finished(req)
    assert finished.error == ""
    assert finished.report.local_encoder_runs == 0 and finished.report.transferred_items == 1
    assert sched.staging.stats()["used_bytes"] == 0
    assert steps_until(lambda: producer.store.stats.acks == 1)


def test_an_input_it_does_not_hold_counts_as_a_local_encoder_run(producer, half):
    sched = half
    req = _audio_request("r2", "clip2", None)  # no encoder named: vLLM encodes it on the LM
    assert sched.ensure_cache_available(req, 0)
    sched.update_state_after_alloc(req, 0)
    meta = sched.build_meta(SimpleNamespace(scheduled_encoder_inputs={"r2": [0]}, total_num_scheduled_tokens=4,
                                            num_scheduled_tokens={"r2": 4}))
    assert meta.loads == []
    assert sched._stats["r2"].local_encoder_runs == 1


def test_a_decoder_only_model_still_loads_a_landed_item_as_external(producer):
    cfg = ConnectorConfig(staging_bytes=1 << 20, transfer_timeout_s=10.0, model_name="test-model")
    sched = ConsumerScheduler(_config(False), cfg).start()
    try:
        req = request("r3", [("img", 16)], producer.endpoint)
        sched.ensure_cache_available(req, 0)
        producer.store.put("img", embedding(16, 1), claims=(claim_of("r3"),))
        assert steps_until(lambda: sched.has_cache_item("img"))
        sched.request_finished(req)
    finally:
        sched.shutdown()
