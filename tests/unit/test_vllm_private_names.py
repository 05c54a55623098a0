"""Every private vLLM name epd-serve reaches for exists in the installed vLLM, each named with the
place that uses it: a vLLM upgrade that renames one fails here, by name, instead of silently (some
users fall back when a name is missing, e.g. ``layouts_context_free`` would then call every family's
layout context-free, which Gemma 3's is not)."""

from __future__ import annotations

import importlib

import pytest

pytestmark = pytest.mark.unit

pytest.importorskip("vllm")

PRIVATE = [
    ("vllm.entrypoints.serve.exception_handling.handlers.validation", "_format_error",
     "services/lm/frontend.py validation_error: a body's pydantic errors worded as vLLM's server words them"),
    ("vllm.multimodal.processing.processor", "BaseMultiModalProcessor._apply_token_matches",
     "services/encoder/vllm_glue.py layouts_context_free: which families rewrite tokens around an item"),
    ("vllm.multimodal.processing.processor", "BaseMultiModalProcessor._find_mm_placeholders",
     "services/encoder/vllm_glue.py layouts_context_free"),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner._preprocess",
     "ectransfer/connector/encoder_decoder.py: opens the connector's load for an encoder-decoder model"),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner._execute_mm_encoder",
     "ectransfer/connector/encoder_decoder.py: hands the decoder the landed encoder outputs"),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner.maybe_get_ec_connector_output",
     "ectransfer/connector/encoder_decoder.py"),
    ("vllm.v1.worker.gpu_worker", "Worker._make_model_runner",
     "ectransfer/connector/encoder_decoder.py EPDGPUWorker: builds our runner"),
    ("vllm.entrypoints.speech_to_text.base.serving", "SpeechToTextBaseServing._decode_and_chunk_speech",
     "services/encoder/speech.py: an upload's windows, cut as vLLM's serving cuts them"),
    ("vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_scheduler",
     "NixlBaseConnectorScheduler._nixl_handshake_listener",
     "services/lm/nixl_connector.py GuardedNixlScheduler: the handshake thread's target, overridden (guarded)"),
]


def test_the_speech_windows_are_cut_from_what_the_encoder_gives_vllms_serving():
    """services/encoder/speech.py calls ``_decode_and_chunk_speech`` on a holder with the attributes it
    reads in vLLM 0.32: the model's speech-to-text config and the two decode bounds, nothing else of the
    serving object."""
    import inspect
    import re

    from vllm.entrypoints.speech_to_text.base.serving import SpeechToTextBaseServing

    src = inspect.getsource(SpeechToTextBaseServing._decode_and_chunk_speech)
    assert set(re.findall(r"self\.(\w+)", src)) == {"asr_config", "max_audio_decode_duration_s",
                                                     "max_audio_decode_bytes"}


def test_the_lms_speech_servings_decode_render_and_detect_through_what_guard_servings_wraps():
    """services/lm/speech.py guard_servings charges and names through three attributes of each vLLM 0.32
    speech-to-text serving: ``_decode_and_chunk_speech_async`` (set in ``__init__`` from
    ``_decode_and_chunk_speech``, awaited by ``_preprocess_speech_to_text``), ``renderer``
    (``render_cmpl_async`` renders the windows' prompts) and ``engine_client`` (``_detect_language``
    submits its prompt unrendered); and services/common/vllm_media.py processor_audio_rate reads the
    processor's resampling rate from its data parser."""
    import inspect

    from vllm.entrypoints.speech_to_text.base.serving import SpeechToTextBaseServing
    from vllm.multimodal.parse import MultiModalDataParser

    init = inspect.getsource(SpeechToTextBaseServing.__init__)
    assert "self._decode_and_chunk_speech_async = make_async_with_semaphore(\n" \
           "            self._decode_and_chunk_speech," in init
    pre = inspect.getsource(SpeechToTextBaseServing._preprocess_speech_to_text)
    assert "await self._decode_and_chunk_speech_async(audio_data)" in pre
    assert "await self.renderer.render_cmpl_async(parsed_prompts)" in pre
    assert "self.engine_client.generate(" in inspect.getsource(SpeechToTextBaseServing._detect_language)
    assert MultiModalDataParser(target_sr=16000).audio_resampler.target_sr == 16000


def test_the_runner_step_reads_what_the_encoder_decoder_runner_gives_it():
    """ectransfer/connector/encoder_decoder.py relies on vLLM 0.32's step: ``_preprocess`` returns the
    connector's report last and passes ``encoder_outputs = self._execute_mm_encoder(...)`` to an
    encoder-decoder model; the runner keeps ``encoder_cache`` and ``requests``."""
    import inspect

    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    src = inspect.getsource(GPUModelRunner._preprocess)
    assert "encoder_outputs = self._execute_mm_encoder(scheduler_output)" in src
    assert "ECConnectorOutput | None,\n    ]:" in src
    init = inspect.getsource(GPUModelRunner.__init__)
    assert "self.encoder_cache" in init and "self.requests" in init


@pytest.mark.parametrize("module,name,used_by", PRIVATE, ids=[n for _, n, _ in PRIVATE])
def test_the_private_name_exists(module, name, used_by):
    obj = importlib.import_module(module)
    for part in name.split("."):
        assert hasattr(obj, part), f"vLLM no longer has {module}.{name}, used by {used_by}"
        obj = getattr(obj, part)
    assert callable(obj), f"{module}.{name} is not callable any more ({used_by})"


def test_every_video_loader_prepares_its_source():
    """services/common/vllm_media.py frames_sampled_by calls ``loader._prepare_source`` (each loader's
    own rule for the frames it decodes, which the decode budget is charged for)."""
    from vllm.multimodal.video import VIDEO_LOADER_REGISTRY

    loaders = VIDEO_LOADER_REGISTRY.name2class
    assert loaders, "vLLM's video loader registry is empty"
    for name, cls in loaders.items():
        assert callable(getattr(cls, "_prepare_source", None)), f"video loader {name} has no _prepare_source"


@pytest.mark.parametrize("family", ["idefics3", "gemma3"])
def test_model_classes_carry_their_processor_factory(family):
    """services/encoder/vllm_glue.py layouts_context_free reads ``model_cls._processor_factory.processor``
    (the multimodal processor vLLM registered for the architecture); Gemma 3's overrides the token
    matching, Idefics3's does not."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.model_executor.models.registry import ModelRegistry
    from vllm.multimodal.processing.processor import BaseMultiModalProcessor

    from services.cli import default_model

    mc = AsyncEngineArgs(model=default_model(family=family)).create_model_config()
    model_cls, _ = ModelRegistry.resolve_model_cls(mc.architectures, mc)
    proc = getattr(getattr(model_cls, "_processor_factory", None), "processor", None)
    assert isinstance(proc, type), f"{model_cls.__name__} has no _processor_factory.processor"
    overridden = proc._apply_token_matches is not BaseMultiModalProcessor._apply_token_matches
    assert overridden == (family == "gemma3"), (family, proc)
