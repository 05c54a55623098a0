"""Issue 35, the narrow path tried at the engine level: a Whisper-class model's encoder outputs made by
one vLLM engine (an ``ec_producer``) and decoded by another, through vLLM's extension points only.

Four engines on the tiny offline Whisper, each in a child interpreter: plain vLLM (the reference); a
producer (vLLM's ``ECExampleConnector``: each encoder output to a file, by mm_hash) that runs the
encoder alone; a consumer whose connector leaves each item to vLLM's local path but loads its output
(``whisper_seam_connector.SeamConsumer``) and whose worker is ours (``worker_cls``:
``ectransfer.connector.encoder_decoder``, the runner hands the loaded outputs to the decoder), taking
the clips in another order (outputs are named by content: ``multi_modal_uuids``); the same consumer with
every loaded output negated; and with vLLM's own runner. The consumer's greedy tokens equal plain
vLLM's and its encoder never runs; the negated outputs change the tokens; vLLM's runner ignores the
loaded outputs and encodes.

Slow (``make test-all``): five engine starts, about two minutes."""

from __future__ import annotations

import hashlib
import io
import json
import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]

RESULT = "whisper-seam-result: "
SEEDS = (0, 1, 2)


def _clip(seed: int):
    import soundfile

    from tools.media import make_audio

    wave, _ = soundfile.read(io.BytesIO(make_audio(seed=seed, seconds=1.0 + seed)), dtype="float32")
    return wave


def _run(phase: str, path: str, store: str) -> dict:
    """Child process: one engine in ``phase`` (plain, producer, consumer); prints a JSON summary."""
    from vllm import LLM, SamplingParams
    from vllm.config.speech_to_text import SpeechToTextParams
    from vllm.model_executor.models.whisper import WhisperForConditionalGeneration as Whisper

    from ectransfer.connector.encoder_decoder import WORKER_CLS

    kwargs = {}
    if phase == "producer":
        kwargs["ec_transfer_config"] = {"ec_connector": "ECExampleConnector", "ec_role": "ec_producer",
                                        "ec_connector_extra_config": {"shared_storage_path": store}}
    elif phase == "epd-consumer":  # epd-serve's own connector, fed by `epd encoder` over Transfer
        from ectransfer.connector.config import ConnectorConfig, ec_transfer_config

        kwargs["ec_transfer_config"] = ec_transfer_config("ec_consumer", ConnectorConfig(
            staging_bytes=64 << 20, model_name=path, transfer_timeout_s=60))
        kwargs["worker_cls"] = WORKER_CLS["cpu"]
    elif phase == "consumer":
        kwargs["ec_transfer_config"] = {"ec_connector": "SeamConsumer", "ec_role": "ec_consumer",
                                        "ec_connector_module_path": "tests.integration.whisper_seam_connector",
                                        "ec_connector_extra_config": {"shared_storage_path": store}}
        if os.environ.get("SEAM_WORKER") == "1":
            kwargs["worker_cls"] = WORKER_CLS["cpu"]
    llm = LLM(model=path, max_model_len=448, enforce_eager=True, dtype="bfloat16", seed=0,
              limit_mm_per_prompt={"audio": 1}, kv_cache_memory_bytes=64 << 20, max_num_seqs=4, **kwargs)

    def count_encodes(worker):
        model = worker.model_runner.model
        model.seam_encodes, embed = 0, model.embed_multimodal

        def counted(**kw):
            model.seam_encodes += 1
            return embed(**kw)

        model.embed_multimodal = counted
        return type(worker.model_runner).__name__

    runner = llm.collective_rpc(count_encodes)[0]
    stt = Whisper.get_speech_to_text_config(llm.model_config, "transcribe")
    sources = json.loads(os.environ.get("SEAM_SOURCES", "{}"))  # seed -> [identifier, ItemSource dict]
    # The file consumer takes the clips in the other order: what names an output is its content, as in
    # epd-serve (the identifier the gateway and the encoder compute), not a request's position.
    order = SEEDS[::-1] if phase == "consumer" else SEEDS
    prompts, params = [], []
    for seed in order:
        prompt = Whisper.get_generation_prompt(SpeechToTextParams(
            audio=_clip(seed), stt_config=stt, model_config=llm.model_config, language="en", task_type="transcribe"))
        ident, src = sources.get(str(seed)) or (hashlib.sha256(_clip(seed).tobytes()).hexdigest(), None)
        prompt["encoder_prompt"]["multi_modal_uuids"] = {"audio": [ident]}
        prompts.append(prompt)
        extra = {"ec_transfer_params": {"items": {ident: src}}} if src else None
        params.append(SamplingParams(temperature=0.0, max_tokens=1 if phase == "producer" else 40, extra_args=extra))
    outs = llm.generate(prompts, params, use_tqdm=False)
    encodes = llm.collective_rpc(lambda worker: worker.model_runner.model.seam_encodes)[0]
    tokens = dict(zip(order, ([*o.outputs[0].token_ids] for o in outs)))
    tokens = [tokens[seed] for seed in SEEDS]
    return {"runner": runner, "encodes": encodes, "tokens": tokens}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    from tools.tiny_model import build_tiny_model

    tmp = tmp_path_factory.mktemp("whisper-seam")
    path = str(build_tiny_model(tmp / "whisper", family="whisper"))
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = {}
    for name, phase, negate, worker in (("plain", "plain", "0", "0"), ("producer", "producer", "0", "0"),
                                        ("consumer", "consumer", "0", "1"), ("negated", "consumer", "1", "1"),
                                        ("vllm-runner", "consumer", "0", "0")):
        log = tmp / f"{name}-loaded.txt"
        env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1",
                   VLLM_ENABLE_V1_MULTIPROCESSING="0", SEAM_NEGATE=negate, SEAM_WORKER=worker, SEAM_LOG=str(log))
        proc = subprocess.run([sys.executable, "-m", "tests.integration.test_whisper_apart_seam", phase, path,
                               str(tmp / "store")], cwd=root, env=env, capture_output=True, text=True, timeout=600)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(RESULT)]
        assert proc.returncode == 0 and lines, (name, proc.stdout[-3000:], proc.stderr[-5000:])
        out[name] = json.loads(lines[-1][len(RESULT):])
        out[name]["loaded"] = log.read_text().split() if log.exists() else []
    out["epd"] = _through_epd_encoder(path, root, tmp)
    return out


def _through_epd_encoder(path: str, root: str, tmp) -> dict:
    """`epd encoder` on the model (its engine an ``ec_producer`` with epd-serve's connector), each clip
    encoded through its Encode API; then a consumer engine with epd-serve's connector and worker, each
    prompt naming the item's encoder (``ec_transfer_params``, as the LM sets it), the output read over
    Transfer."""
    import grpc

    from epd.encoder.v1 import encoder_pb2, encoder_pb2_grpc
    from services.up import free_port
    from tools.media import make_audio

    port, transfer_port = free_port(), free_port()
    with open(tmp / "encoder.log", "w") as log:
        encoder = subprocess.Popen([sys.executable, "-m", "services.cli", "encoder", "--model", path, "--host",
                                    "127.0.0.1", "--port", str(port), "--transfer-host", "127.0.0.1",
                                    "--transfer-port", str(transfer_port)],
                                   cwd=root, stdout=log, stderr=subprocess.STDOUT)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = encoder_pb2_grpc.EncoderServiceStub(channel)
            grpc.channel_ready_future(channel).result(timeout=300)
            sources = {}
            for seed in SEEDS:
                item = encoder_pb2.MediaItem(modality="audio", data=make_audio(seed=seed, seconds=1.0 + seed))
                events = list(stub.Encode(encoder_pb2.EncodeRequest(request_id=f"clip-{seed}", items=[item]),
                                          timeout=120))
                meta = next(e.metadata for e in events if e.HasField("metadata"))
                src = meta.source
                sources[str(seed)] = [meta.identifier, {"endpoint": src.transfer_endpoint, "embed_width": src.embed_width,
                                                        "dtype": "bfloat16", "claim": src.claim}]
                assert any(e.HasField("encoded") for e in events) and src.num_embeds == 1500  # one 30 s window
        env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1",
                   VLLM_ENABLE_V1_MULTIPROCESSING="0", SEAM_SOURCES=json.dumps(sources), SEAM_LOG=str(tmp / "epd.txt"))
        proc = subprocess.run([sys.executable, "-m", "tests.integration.test_whisper_apart_seam", "epd-consumer",
                               path, str(tmp / "unused")], cwd=root, env=env, capture_output=True, text=True,
                              timeout=600)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(RESULT)]
        assert proc.returncode == 0 and lines, (proc.stdout[-3000:], proc.stderr[-5000:])
        out = json.loads(lines[-1][len(RESULT):])
        return out
    finally:
        encoder.terminate()
        encoder.wait(60)


def test_the_producer_runs_the_encoder_and_writes_each_output(runs):
    assert runs["producer"]["encodes"] >= 1
    assert runs["producer"]["loaded"] == []


def test_the_consumer_decodes_transferred_outputs_exactly_without_encoding(runs):
    assert runs["consumer"]["runner"].startswith("EPD"), runs["consumer"]["runner"]
    assert runs["consumer"]["encodes"] == 0  # every item's output came through the connector
    assert len(set(runs["consumer"]["loaded"])) == len(SEEDS)
    assert runs["consumer"]["tokens"] == runs["plain"]["tokens"]
    assert len({tuple(t) for t in runs["plain"]["tokens"]}) == len(SEEDS)  # the audio decides the text


def test_outputs_changed_in_transit_change_the_text(runs):
    assert runs["negated"]["encodes"] == 0
    assert len(set(runs["negated"]["loaded"])) == len(SEEDS)
    assert runs["negated"]["tokens"] != runs["plain"]["tokens"]


def test_the_encoder_service_encodes_and_the_lm_decodes_over_transfer_exactly(runs):
    """The whole path but the gateway: `epd encoder` serves the model's encoder (Encode API, its engine an
    ec_producer), an engine with epd-serve's connector and worker reads each output over Transfer and
    decodes it: plain vLLM's tokens, no encoder run on the consumer."""
    assert runs["epd"]["runner"].startswith("EPD")
    assert runs["epd"]["encodes"] == 0
    assert runs["epd"]["tokens"] == runs["plain"]["tokens"]


def test_with_vllms_own_runner_the_loaded_outputs_go_unused_and_the_encoder_runs(runs):
    """The same connector without our worker: vLLM's runner encodes every item itself (right tokens, but
    the loaded outputs are ignored). The runner is what takes them."""
    assert runs["vllm-runner"]["runner"] == "CPUModelRunner"
    assert runs["vllm-runner"]["encodes"] == len(SEEDS)
    assert runs["vllm-runner"]["tokens"] == runs["plain"]["tokens"]


if __name__ == "__main__":
    print(RESULT + json.dumps(_run(*sys.argv[1:4])), flush=True)
