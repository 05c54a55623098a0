"""Builds the embedded vLLM engine (AsyncLLM) for a service."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)

SERVICE_ENV: dict[str, str] = {
    # huggingface_hub reads these once, when it is first imported (vLLM imports it):
    # nothing at run time may reach a model hub.
    "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
    # vLLM reads these when it uses them (its usage reporter, its executor); its
    # EngineCore and workers inherit them when they are spawned.
    "VLLM_NO_USAGE_STATS": "1", "VLLM_DO_NOT_TRACK": "1",
    # vLLM's engine and worker processes are spawned, not forked: our services have
    # gRPC running before the engine starts, and gRPC does not survive fork() (the
    # child's channels intermittently never connect).
    "VLLM_WORKER_MULTIPROC_METHOD": "spawn",
    "TOKENIZERS_PARALLELISM": "false",
}
"""The environment a service process runs vLLM under; a variable already set wins."""


def configure_process_env() -> None:
    """Sets ``SERVICE_ENV`` in ``os.environ`` where unset (the operator's own value
    wins). Called by each entry point that runs vLLM in this process before anything
    imports vLLM: huggingface_hub fixes its offline flag when first imported. The
    ``epd encoder`` / ``epd lm`` commands call it before importing the service's module
    (``services.encoder.server``, ``services.lm.server`` and what they import load vLLM at
    their top); their ``serve()`` calls it again for in-process callers (tests), and
    ``tools.reference.run`` before its own import. Called late, the offline setting
    reaches only the engine processes vLLM spawns, which is logged. This module itself
    imports vLLM only inside functions: the command imports it, and a gateway must not
    load vLLM."""
    late = "huggingface_hub" in sys.modules and "HF_HUB_OFFLINE" not in os.environ
    for key, value in SERVICE_ENV.items():
        os.environ.setdefault(key, value)
    if late:
        logger.warning("huggingface_hub was imported before the service environment was set: offline mode "
                       "applies to vLLM's engine processes, not to this one")


@dataclass
class EngineConfig:
    model: str = ""
    """Model directory or name (default: the built-in tiny model)."""
    dtype: str = "bfloat16"
    """Weights and activations dtype."""
    max_model_len: int = 0
    """Longest prompt + output in tokens (0: the model's own limit)."""
    max_num_seqs: int = 8
    """Concurrent sequences per engine step."""
    kv_cache_bytes: int = 64 << 20
    """KV cache size in bytes (0: let vLLM size it from free memory)."""
    enforce_eager: bool = True
    """Skip graph capture (fast start; set False on GPU hosts for speed)."""
    seed: int = 0
    """Engine seed."""
    max_images_per_prompt: int = 8
    """vLLM's limit_mm_per_prompt for images."""
    max_audios_per_prompt: int = 8
    """vLLM's limit_mm_per_prompt for audio clips (models without audio ignore it)."""
    max_videos_per_prompt: int = 2
    """vLLM's limit_mm_per_prompt for videos (models without video ignore it)."""
    device: str = "auto"
    """"auto", "cpu" or "cuda" (informational; vLLM picks the platform)."""
    cpu_cores: str = ""
    """CPU hosts: cores the engine's worker binds, e.g. "0-3" (vLLM's VLLM_CPU_OMP_THREADS_BIND;
    empty: vLLM's auto). Give engines sharing a host disjoint cores."""
    executor: str = "auto"
    """How the engine runs its model: "uni" (vLLM's UniProcExecutor: the model runs in the EngineCore
    process), "mp" (vLLM's MultiprocExecutor: a worker process beside it) or "auto": "uni" on a CPU host
    for a one-worker engine, vLLM's own choice elsewhere (single-GPU engines are "uni" there already).
    On CPU vLLM picks "mp" by itself, whose worker busy-waits on a shared-memory queue for a second after
    every step (an LM whose requests wait for items would burn a core on it)."""
    vllm_args: dict[str, Any] = field(default_factory=dict)
    """Extra vLLM engine arguments, e.g. {"tensor_parallel_size": 2} (JSON on the command line)."""

    def __post_init__(self) -> None:
        if self.dtype not in ("bfloat16", "float16", "float32", "auto"):
            raise ValueError(f"dtype must be one of bfloat16, float16, float32, auto; got {self.dtype!r}")
        if self.executor not in ("auto", "uni", "mp"):
            raise ValueError(f"executor must be auto, uni or mp; got {self.executor!r}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device must be auto, cpu or cuda; got {self.device!r}")
        if isinstance(self.vllm_args, str):
            self.vllm_args = json.loads(self.vllm_args)


def engine_kwargs(cfg: EngineConfig, ec_transfer_config: dict[str, Any] | None = None) -> dict[str, Any]:
    kw: dict[str, Any] = dict(
        model=cfg.model,
        dtype=cfg.dtype,
        max_num_seqs=cfg.max_num_seqs,
        enforce_eager=cfg.enforce_eager,
        seed=cfg.seed,
        limit_mm_per_prompt={"image": cfg.max_images_per_prompt, "audio": cfg.max_audios_per_prompt,
                             "video": cfg.max_videos_per_prompt},
    )
    if cfg.max_model_len:
        kw["max_model_len"] = cfg.max_model_len
    if cfg.kv_cache_bytes:
        kw["kv_cache_memory_bytes"] = cfg.kv_cache_bytes
    if ec_transfer_config is not None:
        from vllm.config import ECTransferConfig

        kw["ec_transfer_config"] = ECTransferConfig(**ec_transfer_config)
    kw.update(cfg.vllm_args)
    return kw


class UnsupportedModel(ValueError):
    """A model the service must not serve as configured (refused before its engine starts)."""


def is_encoder_decoder(cfg: EngineConfig) -> bool:
    """Whether ``cfg.model`` is an encoder-decoder model (Whisper-class), read from its config the way
    vLLM reads it (``ModelConfig.is_encoder_decoder``), before any engine starts."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    return AsyncEngineArgs(**engine_kwargs(cfg)).create_model_config().is_encoder_decoder


ENCODER_DECODER_GAP = (
    "vLLM 0.32 by itself never loads a transferred encoder output into an encoder-decoder model's cross-attention "
    "(its scheduler allocates cross-attention blocks only for inputs it encodes itself, and its model "
    "runner's encoder-decoder path never asks the EC connector to load), so an engine fed from an encoder "
    "would decode without the audio")


def encoder_apart_verified(cfg: EngineConfig) -> bool:
    """Whether this install's vLLM runs an encoder-decoder model's encoder apart by the path epd-serve
    verified (``ectransfer.connector.encoder_decoder``): vLLM 0.32 with its V1 model runner,
    whose ``_preprocess`` and ``_execute_mm_encoder`` our runner overrides (an engine that picks the V2 runner
itself is refused by our worker). Read at start, never per request."""
    import vllm
    from vllm import envs

    return vllm.__version__.startswith("0.32.") and envs.VLLM_USE_V2_MODEL_RUNNER is not True


def refuse_encoder_decoder(cfg: EngineConfig, role: str) -> None:
    """The encoder-decoder guard, for the encoder service, where the path is not verified
    (``encoder_apart_verified``): an encoder for an encoder-decoder model is refused at start (``role``:
    who refuses, for the message)."""
    if is_encoder_decoder(cfg) and not encoder_apart_verified(cfg):
        raise UnsupportedModel(
            f"{cfg.model} is an encoder-decoder model (Whisper-class): the {role} cannot serve it with this "
            f"vLLM. {ENCODER_DECODER_GAP}; epd-serve refuses rather than answer wrongly. Serve it with `epd lm` "
            "alone (the LM encodes the audio itself).")


def placeholder_metadata_fields(cfg: EngineConfig,
                                modalities: tuple[str, ...] = ("image", "audio", "video")) -> set[str]:
    """The processed fields this model's data parser declares as placeholder metadata for
    ``modalities`` (vLLM's ``embedding_fields``; Qwen-VL: ``image_grid_thw``, Qwen2-Audio:
    ``audio_num_tokens``), read from the model's config and processor before any engine starts;
    empty for models that declare none."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.multimodal import MULTIMODAL_REGISTRY

    model_config = AsyncEngineArgs(**engine_kwargs(cfg)).create_model_config()
    if not model_config.is_multimodal_model:
        return set()
    parser = MULTIMODAL_REGISTRY.create_processor(model_config).info.data_parser
    return set().union(*(parser.placeholder_metadata_fields(m) for m in modalities))


def build_async_engine(cfg: EngineConfig, ec_transfer_config: dict[str, Any] | None = None,
                       ec_manager_config: dict[str, Any] | None = None, **fixed: Any):
    """``fixed``: engine arguments the service needs, over ``cfg.vllm_args``."""
    if cfg.cpu_cores:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = cfg.cpu_cores  # read when the engine's model process starts
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.usage.usage_lib import UsageContext
    from vllm.v1.engine.async_llm import AsyncLLM

    kw = engine_kwargs(cfg, ec_transfer_config)
    if ec_manager_config is not None:
        kw["ec_manager_config"] = ec_manager_config
    kw.update(fixed)
    uni = one_process_on_cpu(cfg, kw)
    if uni or cfg.executor == "mp":
        kw.setdefault("distributed_executor_backend", "uni" if uni else "mp")
    args = AsyncEngineArgs(**kw)
    with _env({"VLLM_ENABLE_V1_MULTIPROCESSING": "0"} if uni else {}):
        vllm_config = args.create_engine_config(UsageContext.ENGINE_CONTEXT)
        with _cpu_threads(vllm_config, uni):
            return AsyncLLM.from_vllm_config(vllm_config, enable_log_requests=args.enable_log_requests,
                                             disable_log_stats=args.disable_log_stats)


def one_process_on_cpu(cfg: EngineConfig, kw: dict[str, Any]) -> bool:
    """Whether the engine runs its model in the EngineCore process on a CPU host (``EngineConfig.executor``):
    "uni" asked for, or "auto" with one worker and no executor named in ``--vllm-args``."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu() or cfg.executor == "mp" or "distributed_executor_backend" in kw:
        return False
    workers = (kw.get("tensor_parallel_size", 1) * kw.get("pipeline_parallel_size", 1)
               * kw.get("data_parallel_size", 1))
    return cfg.executor == "uni" or workers == 1


@contextlib.contextmanager
def _env(values: dict[str, str]):
    """``values`` in ``os.environ`` for the block (the EngineCore process, spawned inside it, inherits
    them), the old ones back after: a test process that starts other engines later is left as it was.
    ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` is what vLLM's CPU platform reads to keep a "uni" executor (it
    swaps it for "mp" otherwise); AsyncLLM runs its EngineCore in a process of its own either way."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def _cpu_threads(vllm_config, uni: bool):
    """With "uni" on CPU, the EngineCore process gets the OpenMP settings (threads, places, binding) that
    vLLM's MultiprocExecutor gives its worker, from vLLM's own ``OMPProcessManager``: the same cores, now
    for the one process."""
    if not uni:
        yield
        return
    from vllm.utils.ompmultiprocessing import OMPProcessManager

    with OMPProcessManager(vllm_config).configure_omp_envs(rank=0, local_rank=0):
        yield


class EngineDied(RuntimeError):
    """The service's vLLM engine (its EngineCore process) is gone: the service
    stops and exits non-zero so its supervisor restarts it."""


def engine_dead(engine) -> bool:
    """True once vLLM's AsyncLLM has given up: its EngineCore process exited
    (vLLM's ``MPClientEngineMonitor`` thread sets ``engine_dead``) or its output
    handler task failed. Both show as ``AsyncLLM.errored``."""
    return bool(engine.errored)


async def watch_engine(engine, on_dead: Callable[[], Awaitable[None]], poll_s: float = 0.5) -> None:
    """Polls ``engine`` every ``poll_s`` seconds and, once it is dead, awaits
    ``on_dead()`` and returns. The services run it as a task beside the gRPC
    server: ``on_dead`` marks them NOT_SERVING at once and makes them stop
    and exit non-zero. Polling a flag (rather than awaiting vLLM's output
    handler) also sees a death while no request is running: vLLM's monitor
    thread notices the process exit on its own."""
    while not engine_dead(engine):
        await asyncio.sleep(poll_s)
    logger.error("the vLLM engine died (EngineCore process gone); stopping this service")
    await on_dead()


async def serve_until_stopped(engine, set_serving: Callable[[bool], Awaitable[None]], stop: asyncio.Event,
                              poll_s: float = 0.5) -> None:
    """A service's main wait: returns when ``stop`` is set (a signal), or
    raises ``EngineDied`` when the engine dies first, right after
    ``set_serving(False)`` (health answers NOT_SERVING before anything else
    happens). The caller's ``finally`` then stops gRPC and the engine in the
    usual order, and the CLI exits 1."""
    died = False

    async def on_dead() -> None:
        nonlocal died
        died = True
        try:
            await set_serving(False)
        finally:
            stop.set()

    watcher = asyncio.create_task(watch_engine(engine, on_dead, poll_s), name="epd-engine-watch")
    try:
        await stop.wait()
    finally:
        watcher.cancel()
    if died:
        raise EngineDied("the vLLM engine process died; the service stopped serving")


def tokenize(renderer, text: str) -> list[int]:
    """``text`` tokenized by vLLM's renderer (``engine.renderer``) as a
    completion prompt: for a multimodal model, exactly as the text around the
    images before the processor expands each placeholder
    (``services.common.layout`` relies on that)."""
    return list(renderer.tokenize_prompt({"prompt": text}, renderer.default_cmpl_tok_params)["prompt_token_ids"])


async def tokenize_async(renderer, text: str) -> list[int]:
    """``tokenize`` on the renderer's own tokenizer thread: the tokenizer is
    never used by two threads at once."""
    out = await renderer.tokenize_prompt_async({"prompt": text}, renderer.default_cmpl_tok_params)
    return list(out["prompt_token_ids"])
