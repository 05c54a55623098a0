"""ectransfer/connector/encoder_decoder.py without an engine: the runner's step order (landed outputs
where the connector supplied them, vLLM's encoder for the rest, in the step's order) and the worker
classes vLLM resolves by name (tests/integration/test_whisper_apart_seam.py runs them in engines)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytestmark = pytest.mark.unit

pytest.importorskip("vllm")


class _VllmRunner:
    """What the mixin reads of vLLM's runner: ``requests``, ``encoder_cache``, the two methods."""

    def __init__(self):
        self.encoder_cache, self.encoded = {}, []
        self.requests = {rid: SimpleNamespace(mm_features=[SimpleNamespace(identifier=f"{rid}-{i}") for i in range(2)])
                         for rid in ("a", "b")}

    def _execute_mm_encoder(self, scheduler_output):
        out = []
        for rid, inputs in scheduler_output.scheduled_encoder_inputs.items():
            for i in inputs:
                ident = self.requests[rid].mm_features[i].identifier
                self.encoded.append(ident)
                self.encoder_cache[ident] = torch.full((2,), float(len(self.encoded)))
                out.append(self.encoder_cache[ident])
        return out


def _runner():
    from ectransfer.connector.encoder_decoder import runner_class

    cls = runner_class(_VllmRunner)
    cls._consumes = lambda self: True  # an encoder-decoder model's EC consumer
    return cls()


def _with(inputs):
    from dataclasses import replace

    from vllm.v1.core.sched.output import SchedulerOutput

    return replace(SchedulerOutput.make_empty(), scheduled_encoder_inputs=inputs)


def test_landed_outputs_replace_the_encoder_and_the_rest_is_encoded_in_the_steps_order():
    runner = _runner()
    landed = torch.tensor([-1.0, -1.0])
    runner.encoder_cache["a-1"] = landed  # the connector injected it at the step's start
    out = runner._execute_mm_encoder(_with({"a": [0, 1], "b": [0]}))
    assert runner.encoded == ["a-0", "b-0"]  # only those the connector did not supply
    assert [t.tolist() for t in out] == [[1.0, 1.0], [-1.0, -1.0], [2.0, 2.0]]
    assert out[1] is landed


def test_with_nothing_landed_it_is_vllms_own_step():
    runner = _runner()
    out = runner._execute_mm_encoder(_with({"a": [0]}))
    assert runner.encoded == ["a-0"] and len(out) == 1


def test_all_landed_encodes_nothing():
    runner = _runner()
    runner.encoder_cache.update({"a-0": torch.zeros(2), "b-1": torch.ones(2)})
    out = runner._execute_mm_encoder(_with({"b": [1], "a": [0]}))
    assert runner.encoded == [] and [t.tolist() for t in out] == [[1.0, 1.0], [0.0, 0.0]]


def test_the_worker_classes_resolve_by_name_and_only_consumers_take_outputs():
    from vllm.utils.import_utils import resolve_obj_by_qualname
    from vllm.v1.worker.cpu_worker import CPUWorker

    from ectransfer.connector.encoder_decoder import WORKER_CLS, takes_encoder_outputs

    assert issubclass(resolve_obj_by_qualname(WORKER_CLS["cpu"]), CPUWorker)

    def cfg(enc_dec, role):
        ec = None if role is None else SimpleNamespace(is_ec_consumer=role == "ec_consumer")
        return SimpleNamespace(model_config=SimpleNamespace(is_encoder_decoder=enc_dec), ec_transfer_config=ec)

    assert takes_encoder_outputs(cfg(True, "ec_consumer"))
    assert not takes_encoder_outputs(cfg(True, "ec_producer"))
    assert not takes_encoder_outputs(cfg(True, None))
    assert not takes_encoder_outputs(cfg(False, "ec_consumer"))
