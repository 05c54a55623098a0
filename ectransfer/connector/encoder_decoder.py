"""An encoder-decoder model's (Whisper-class) encoder outputs from the EC connector: the worker side of running its encoder apart.

vLLM 0.32 hands such a model's encoder output to the decoder's cross-attention once, as
``encoder_outputs = self._execute_mm_encoder(scheduler_output)`` in the model runner's ``_preprocess``,
and opens the EC connector's load (``maybe_get_ec_connector_output``) only for decoder-only models
(docs/design.md, "Encoder-decoder models"). The narrow path, without re-implementing vLLM's step:

- **Scheduler** (the connector's scheduler half, not here): the item is left to vLLM's own "encode it
  here" path (``has_cache_item`` says no), so vLLM's scheduler counts its cross-attention tokens and
  allocates the request's cross-attention blocks exactly as for a local encode, and calls
  ``update_state_after_alloc`` for it, where the half queues the load of the landed output. The request
  is held (``ensure_cache_available``) until the output has landed.
- **Worker** (this module): ``EncoderDecoderConsumerRunner`` opens the connector's load around
  ``_preprocess`` for an encoder-decoder model too (the connector injects the landed outputs into the
  runner's ``encoder_cache``, keyed by ``mm_hash``, and reports what it injected, as for other models),
  and its ``_execute_mm_encoder`` hands back, in the step's order, the landed output of every scheduled
  input the connector supplied and the real encoder's output for the rest (only those are encoded).
- **Producer**: nothing. vLLM's producer step (``execute_model``: ``has_ec_transfer() and not
  is_consumer``) runs ``_execute_mm_encoder`` for every model and saves each output through the
  connector (``_cache_encoder_output`` -> ``maybe_save_ec_to_connector``).

Buffers: the injected tensors belong to vLLM's ``encoder_cache`` from the moment the connector puts them
there; vLLM frees them as for a local encode (``free_encoder_mm_hashes`` of the next steps). The runner
keeps nothing.

Two private vLLM methods are overridden (``_preprocess``, ``_execute_mm_encoder``) and one worker
constructor is reached (``Worker._make_model_runner`` on CUDA, ``CPUWorker.init_device`` on CPU), in
classes of our own that vLLM loads through ``worker_cls``; each private name is checked in
``tests/unit/test_vllm_private_names.py``.
"""

from __future__ import annotations

import dataclasses
import functools

from vllm.distributed.ec_transfer import get_ec_transfer, has_ec_transfer

WORKER_CLS = {
    "cpu": "ectransfer.connector.encoder_decoder.EPDCPUWorker",
    "cuda": "ectransfer.connector.encoder_decoder.EPDGPUWorker",
}
"""vLLM's ``worker_cls`` (``--worker-cls``) per device type, for an encoder-decoder model's EC consumer."""


def takes_encoder_outputs(vllm_config) -> bool:
    """Whether this engine's runner must take encoder outputs from the connector: an encoder-decoder model
    whose engine is an EC consumer."""
    ec = vllm_config.ec_transfer_config
    return bool(vllm_config.model_config.is_encoder_decoder and ec is not None and ec.is_ec_consumer)


class EncoderDecoderConsumerRunner:
    """Mixin placed before vLLM's model runner class (``runner_class``)."""

    def _consumes(self) -> bool:
        return self.model_config.is_encoder_decoder and has_ec_transfer() and get_ec_transfer().is_consumer

    def _preprocess(self, scheduler_output, *args, **kwargs):
        if not self._consumes():
            return super()._preprocess(scheduler_output, *args, **kwargs)
        with self.maybe_get_ec_connector_output(scheduler_output, encoder_cache=self.encoder_cache) as output:
            result = super()._preprocess(scheduler_output, *args, **kwargs)
        return (*result[:-1], output)  # vLLM's slot for the connector's report is None for this model

    def _execute_mm_encoder(self, scheduler_output):
        if not self._consumes() or not scheduler_output.scheduled_encoder_inputs:
            return super()._execute_mm_encoder(scheduler_output)
        order = [(req_id, i, self.requests[req_id].mm_features[i].identifier)
                 for req_id, inputs in scheduler_output.scheduled_encoder_inputs.items() for i in inputs]
        landed = {ident for _, _, ident in order if ident in self.encoder_cache}
        if not landed:
            return super()._execute_mm_encoder(scheduler_output)
        rest: dict[str, list[int]] = {}
        for req_id, i, ident in order:
            if ident not in landed:
                rest.setdefault(req_id, []).append(i)
        if rest:  # vLLM's encoder for the others; it keeps each output in encoder_cache by mm_hash
            super()._execute_mm_encoder(dataclasses.replace(scheduler_output, scheduled_encoder_inputs=rest))
        return [self.encoder_cache[ident] for _, _, ident in order]


@functools.cache
def runner_class(base: type) -> type:
    """``base`` (vLLM's model runner class) with ``EncoderDecoderConsumerRunner`` in front."""
    return type(f"EPD{base.__name__}", (EncoderDecoderConsumerRunner, base), {})


def _require_v1(use_v2_model_runner: bool) -> None:
    """Refuses to start an engine whose runner we cannot take the outputs with: it would decode without
    the audio, silently."""
    if use_v2_model_runner:
        raise RuntimeError("an encoder-decoder model's EC consumer needs vLLM's V1 model runner (set "
                           "VLLM_USE_V2_MODEL_RUNNER=0): epd-serve's runner (ectransfer.connector.encoder_decoder) "
                           "hands the decoder the transferred encoder outputs only there")


def _cpu_worker() -> type:
    import torch
    from vllm.v1.worker.cpu_worker import CPUWorker

    class EPDCPUWorker(CPUWorker):
        """vLLM's CPU worker whose model runner takes an encoder-decoder model's encoder outputs from the
        connector. ``CPUWorker.init_device`` builds its runner inline (no factory method), so the runner is
        built again, as our class, when this engine needs it (its buffers are small; the first is freed)."""

        def init_device(self) -> None:
            super().init_device()
            if takes_encoder_outputs(self.vllm_config):
                _require_v1(self.use_v2_model_runner)
                self.model_runner = runner_class(type(self.model_runner))(self.vllm_config, torch.device("cpu"))

    return EPDCPUWorker


def _gpu_worker() -> type:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    from vllm.v1.worker.gpu_worker import Worker

    class EPDGPUWorker(Worker):
        """vLLM's GPU worker, its runner built by ``_make_model_runner`` (vLLM's override point)."""

        def _make_model_runner(self):
            if takes_encoder_outputs(self.vllm_config):
                _require_v1(self.use_v2_model_runner)
                return runner_class(GPUModelRunner)(self.vllm_config, self.device)
            return super()._make_model_runner()

    return EPDGPUWorker


_WORKERS = {"EPDCPUWorker": _cpu_worker, "EPDGPUWorker": _gpu_worker}


@functools.cache
def __getattr__(name: str) -> type:
    """The worker classes, built on first use: vLLM resolves ``worker_cls`` by name, and only the
    platform's own worker module can be imported (the CPU worker's imports its shared-memory helpers)."""
    if name in _WORKERS:
        return _WORKERS[name]()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
