"""Issue 12, every tiny family through encoder -> LM with the official ``openai`` client: greedy
tokens equal to plain vLLM's (``LLM.chat`` on the same messages) for one item, two items, the same
item twice and an item the encoder processed before; every item encoded on the encoder, nothing
encoded on the LM. LLaVA-1.5 (placeholder replacements), Qwen2.5-VL (M-RoPE: each image's grid
travels as metadata) and Qwen2-Audio (audio as OpenAI ``input_audio`` and vLLM ``audio_url`` parts;
each clip's token count travels as metadata) are laid out on the LM from the encoder's metadata (no
processor runs there); Gemma 3's layout depends on the prompt around each image (vLLM merges the
newlines it adds with the prompt's), so its encoder sends no layout and the LM lays the prompt out
with its processor (``services.encoder.vllm_glue.layouts_context_free``). One deployment and one
reference run per family (tiny offline checkpoints, ``tools/tiny_families``)."""

from __future__ import annotations

import base64
import time

import pytest

from services.up import Deployment
from tests import ahead
from tests.e2e.conftest import stop_in_background
from tests.e2e.helpers import (
    LATE_S,
    TEARDOWN_DRAIN_S,
    check_perturbation_changes_tokens,
    late_items,
    metric,
    perturb_chat,
    perturbable,
    post,
    producer_stats,
    settled,
)
from tools.media import data_url, make_audio, make_image, make_video
from tools.reference import launch

pytestmark = pytest.mark.e2e


def _chat(images: list[int], text: str) -> dict:
    content = [{"type": "image_url", "image_url": {"url": data_url(make_image(seed, (96, 80)))}} for seed in images]
    return {"messages": [{"role": "user", "content": [*content, {"type": "text", "text": text}]}],
            "max_tokens": 10, "temperature": 0, "return_token_ids": True}


def _audio_chat(clips: list[int], text: str) -> dict:
    """Audio as OpenAI's input_audio parts and vLLM's audio_url parts, alternately."""
    content = []
    for k, seed in enumerate(clips):
        wav = make_audio(seed, 0.6 + 0.2 * (seed % 3))
        content.append({"type": "input_audio", "input_audio": {"data": base64.b64encode(wav).decode(),
                                                               "format": "wav"}} if k % 2 == 0 else
                       {"type": "audio_url", "audio_url": {"url": data_url(wav, "audio/wav")}})
    return {"messages": [{"role": "user", "content": [*content, {"type": "text", "text": text}]}],
            "max_tokens": 10, "temperature": 0, "return_token_ids": True}


REQUESTS = {
    "one": _chat([11], "What is in this picture?"),
    "two": _chat([12, 13], "Compare the two pictures."),
    "twice": _chat([14, 14], "Are these the same?"),
    "again": _chat([11], "Describe it again."),  # an image the encoder processed before (its caches hit)
}
AUDIO_REQUESTS = {
    "one": _audio_chat([21], "What is this sound?"),
    "two": _audio_chat([22, 23], "Compare the two sounds."),
    "twice": _audio_chat([24, 24], "Are these the same?"),
    "again": _audio_chat([21], "Describe it again."),
}


def _recorded_chat(clips: list[tuple[str, int, int]], text: str) -> dict:
    """Clips as people record them, (format, rate, channels), resampled to 16 kHz mono by vLLM."""
    content = []
    for k, (fmt, rate, channels) in enumerate(clips):
        clip = make_audio(25 + k, 0.8, rate=rate, fmt=fmt, channels=channels)
        mime = {"WAV": "audio/wav", "FLAC": "audio/flac", "MP3": "audio/mpeg", "OGG": "audio/ogg"}[fmt]
        content.append({"type": "input_audio", "input_audio": {"data": base64.b64encode(clip).decode(),
                                                               "format": fmt.lower()}} if fmt in ("WAV", "MP3") else
                       {"type": "audio_url", "audio_url": {"url": data_url(clip, mime)}})
    return {"messages": [{"role": "user", "content": [*content, {"type": "text", "text": text}]}],
            "max_tokens": 10, "temperature": 0, "return_token_ids": True}


RECORDED_REQUESTS = {
    "wav-8k-flac-44k-stereo": _recorded_chat([("WAV", 8000, 1), ("FLAC", 44100, 2)], "Compare the two sounds."),
    "wav-48k-stereo-mp3-44k": _recorded_chat([("WAV", 48000, 2), ("MP3", 44100, 1)], "Compare the two sounds."),
    "ogg-48k": _recorded_chat([("OGG", 48000, 1)], "What is this sound?"),
}
"""Issue 35: audio at the rates and in the formats people record (vLLM resamples with torchaudio's
resampler, decodes MP3 and OGG with PyAV or libsndfile: its ``audio`` extra, tools/torchaudio_cpu.py)."""




def _video_chat(parts: list[tuple[str, int]], text: str) -> dict:
    """Videos (MP4 from OpenCV's writer, vLLM's video_url parts) and images, in order."""
    content = [{"type": "video_url", "video_url": {"url": data_url(make_video(seed, frames=8), "video/mp4")}}
               if kind == "video" else {"type": "image_url", "image_url": {"url": data_url(make_image(seed, (96, 80)))}}
               for kind, seed in parts]
    return {"messages": [{"role": "user", "content": [*content, {"type": "text", "text": text}]}],
            "max_tokens": 10, "temperature": 0, "return_token_ids": True}


VIDEO_REQUESTS = {
    "video": _video_chat([("video", 31)], "What happens in this video?"),
    "video-image": _video_chat([("video", 32), ("image", 33)], "Does the picture appear in the video?"),
    "video-twice": _video_chat([("video", 34), ("video", 34)], "Are these the same?"),
}
LATE_REQUESTS = {
    "qwen2_audio": _audio_chat([41, 42, 43], "Compare the three sounds."),
    "qwen2_5_vl": _video_chat([("video", 44), ("video", 45), ("image", 46)], "Compare them."),
}
"""Issue 34: three items never sent before, the second reported late by the encoder (``late_items``)."""


LAID_OUT_BY = {"llava": "encoder", "gemma3": "processor", "qwen2_5_vl": "encoder", "qwen3_vl": "encoder",
               "qwen2_audio": "encoder"}

SLOW_FAMILIES = {
    "llava": "placeholder replacements laid out from the encoder's metadata: Qwen2.5-VL's and Qwen2-Audio's "
             "layouts take the same path in the default run",
    "qwen3_vl": "M-RoPE grids and video as metadata: Qwen2.5-VL's cases (video included) take the same path "
                "in the default run",
}
"""Families whose deployments run in the slow tier only (``make test-all``), each with what covers its path
in the default run; their reference runs start only when they are selected."""


def family_param(name: str):
    return pytest.param(name, marks=pytest.mark.slow) if name in SLOW_FAMILIES else name


def _requests(family: str) -> dict[str, dict]:
    late = {"late": LATE_REQUESTS[family]} if family in LATE_REQUESTS else {}
    if family == "qwen2_audio":
        return {**AUDIO_REQUESTS, **RECORDED_REQUESTS, **late}
    return {**REQUESTS, **VIDEO_REQUESTS, **late} if family in ("qwen2_5_vl", "qwen3_vl") else REQUESTS


class _Reference:
    """A family's reference run (``tools.reference.launch``): ``result`` is plain vLLM's tokens and expanded
    prompts by request name."""

    def __init__(self, family: str, prefix: tuple[str, ...] = ()) -> None:
        from services.cli import default_model

        self.bodies = {**_requests(family), **(PERTURB if family == "qwen2_5_vl" else {})}
        self.run = launch(default_model(family=family), list(self.bodies.values()), with_prompts=True, prefix=prefix)

    def result(self) -> tuple[dict, dict]:
        results = dict(zip(self.bodies, self.run.result()))
        return {n: r["tokens"] for n, r in results.items()}, {n: r["prompt_token_ids"] for n, r in results.items()}


_REFERENCES: dict[str, _Reference] = {}


def start_references(families=None, prefix: tuple[str, ...] = ()) -> None:
    """Launches the reference runs of ``families`` (None: every family): from the session's start for the
    families selected (tests/early.py), so that they run while other tiers run and each family's deployment
    then starts alone; else from the family's fixture, beside its deployment starting."""
    for name in LAID_OUT_BY:
        if (families is None or name in families) and name not in _REFERENCES:
            _REFERENCES[name] = _Reference(name, prefix)


def stop_references() -> None:
    for ref in _REFERENCES.values():
        ref.run.stop()


def _deployment(name: str) -> Deployment:
    """The family's deployment, unstarted, with the perturbation hook (off until its test turns it on)."""
    from services.cli import default_model

    return perturbable(Deployment(model=default_model(family=name), quiet=True, drain_grace_s=TEARDOWN_DRAIN_S))


ahead.register(__name__, "family", _deployment, param="family")


@pytest.fixture(scope="module", params=[family_param(n) for n in LAID_OUT_BY])
def family(request):
    """The family's deployment and plain vLLM's answers (tokens and expanded prompts) to its requests."""
    from services.cli import default_model

    start_references([request.param])  # no-op when the session started it
    model = default_model(family=request.param)
    ready = ahead.take(__name__, request.param)
    dep = ready or _deployment(request.param)
    try:
        if ready is None:
            dep.start()
        reference, prompts = _REFERENCES[request.param].result()
    except BaseException:
        dep.stop()
        raise
    yield request.param, dep, reference, prompts, model
    stop_in_background(dep)


@pytest.mark.parametrize("name", list(REQUESTS))
def test_family_matches_plain_vllm_with_every_image_encoded_remotely(family, name):
    _check(family, name)


@pytest.mark.parametrize("family", ["qwen2_audio"], indirect=True)  # the audio deployment
@pytest.mark.parametrize("name", list(RECORDED_REQUESTS))
def test_audio_at_8_to_48_khz_mono_or_stereo_in_each_format_matches_plain_vllm(family, name):
    _check(family, name)


@pytest.mark.parametrize("family", [family_param("qwen2_5_vl"), family_param("qwen3_vl")],
                         indirect=True)  # the deployments of the image cases
@pytest.mark.parametrize("name", list(VIDEO_REQUESTS))
def test_qwen_vl_video_matches_plain_vllm_with_every_item_encoded_remotely(family, name):
    """Video (vLLM's video_url, decoded on the encoder by vLLM's opencv backend): each video's grid
    (and Qwen2.5-VL's seconds per grid) travel as metadata (M-RoPE), the LM lays the prompt out
    (Qwen3-VL's expansion has the frames' timestamps in it: the layout carries them)."""
    _check(family, name)


PERTURB = {f"perturb{i}": perturb_chat(9100 + i) for i in range(3)}


@pytest.mark.parametrize("family", ["qwen2_audio", "qwen2_5_vl"], indirect=True)
def test_audio_and_video_are_computed_in_step_with_a_late_item(family):
    """Issue 34 for audio and video: with the second of three items reported late by the encoder, the LM
    computes the prompt past the first item before the second lands (``prefill_ahead_tokens`` grows by
    at least the first item's placeholder), nothing is encoded on the LM, and the tokens are plain vLLM's."""
    fam, dep, reference, prompts, _ = family
    from transformers import AutoTokenizer

    placeholder = AutoTokenizer.from_pretrained(family[4]).convert_tokens_to_ids(
        "<|video_pad|>" if fam == "qwen2_5_vl" else PLACEHOLDER[fam])
    ids = prompts["late"]
    first = ids.index(placeholder)
    first_len = next(k for k in range(first, len(ids)) if ids[k] != placeholder) - first
    ahead0 = metric(dep.lm_metrics, "epd_ec_prefill_ahead_tokens", role="consumer")
    lm_runs = metric(dep.lm_metrics, "epd_lm_local_encoder_runs_total")
    with late_items(dep):
        t0 = time.monotonic()
        status, body = post(dep.url + "/v1/chat/completions", _requests(fam)["late"], 120)
        elapsed = time.monotonic() - t0
    assert status == 200, body
    assert body["choices"][0]["token_ids"] == reference["late"], fam
    assert elapsed >= LATE_S, elapsed  # the second item was late
    ahead = settled(lambda: metric(dep.lm_metrics, "epd_ec_prefill_ahead_tokens", role="consumer") - ahead0, -1,
                    timeout=5)
    assert ahead >= first_len > 0, (ahead, first_len)
    assert metric(dep.lm_metrics, "epd_lm_local_encoder_runs_total") == lm_runs


@pytest.mark.parametrize("family", ["qwen2_5_vl"], indirect=True)
def test_an_embedding_changed_in_transit_changes_the_tokens(family):
    """The LM generates from the transferred embedding, for a family whose items travel as
    metadata-only items (Qwen2.5-VL: the grid drives M-RoPE): see tests/e2e/test_perturbation.py."""
    _, dep, reference, _, _ = family
    check_perturbation_changes_tokens(dep, list(PERTURB.values()), [reference[n] for n in PERTURB])


PLACEHOLDER = {"qwen2_audio": "<|AUDIO|>", "qwen2_5_vl": "<|image_pad|>", "qwen3_vl": "<|image_pad|>",
               "gemma3": "<image_soft_token>", "llava": "<image>"}


def test_vllm_expands_each_item_like_the_familys_transformers_processor(family):
    """The tiny checkpoint is one vLLM and transformers read alike: plain vLLM's prompt for one item
    (from the reference run) is token for token what the family's own transformers processor makes
    of the same chat, and the placeholder is expanded."""
    import io

    from transformers import AutoProcessor

    fam, _, _, prompts, model = family
    processor = AutoProcessor.from_pretrained(model)
    part = _requests(fam)["one"]["messages"][0]["content"][0]
    if fam == "qwen2_audio":
        import soundfile

        wave, rate = soundfile.read(io.BytesIO(base64.b64decode(part["input_audio"]["data"])), dtype="float32")
        modality, kw = "audio", {"audio": wave, "sampling_rate": rate}
    else:
        from PIL import Image

        image = Image.open(io.BytesIO(base64.b64decode(part["image_url"]["url"].split(",", 1)[1]))).convert("RGB")
        modality, kw = "image", {"images": [image]}
    text = _requests(fam)["one"]["messages"][0]["content"][-1]["text"]
    chat = [{"role": "user", "content": [{"type": modality}, {"type": "text", "text": text}]}]
    prompt = processor.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    hf_ids = processor(text=[prompt], return_tensors="np", **kw)["input_ids"][0].tolist()
    placeholder = processor.tokenizer.convert_tokens_to_ids(PLACEHOLDER[fam])
    assert prompts["one"].count(placeholder) > 1
    assert prompts["one"] == hf_ids, fam


def _check(family, name: str) -> None:
    from openai import OpenAI

    fam, dep, reference, _, _ = family
    client = OpenAI(base_url=dep.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    lm_runs = metric(dep.lm_metrics, "epd_lm_local_encoder_runs_total")
    layouts = {by: metric(dep.lm_metrics, "epd_lm_prompt_layouts_total", by=by) for by in ("encoder", "processor")}
    body = dict(_requests(fam)[name])
    extra = {"return_token_ids": body.pop("return_token_ids")}

    resp = client.chat.completions.create(model="", extra_body=extra, **body)

    assert resp.choices[0].model_extra["token_ids"] == reference[name], fam
    assert resp.model_extra["epd"]["placement"] == "encoder"
    assert metric(dep.lm_metrics, "epd_lm_local_encoder_runs_total") == lm_runs  # nothing encoded on the LM
    by, other = LAID_OUT_BY[fam], {"encoder": "processor", "processor": "encoder"}[LAID_OUT_BY[fam]]
    # The processor path counts prompts whose embeddings were all transferred; an image seen before
    # may still sit in the LM's own encoder cache (nothing transferred, nothing counted).
    step = 0 if (by, name) == ("processor", "again") else 1
    assert settled(lambda: metric(dep.lm_metrics, "epd_lm_prompt_layouts_total", by=by),
                   layouts[by] + step) == layouts[by] + step
    assert metric(dep.lm_metrics, "epd_lm_prompt_layouts_total", by=other) == layouts[other]


@pytest.mark.parametrize("family", ["qwen2_audio"], indirect=True)  # the audio deployment above
def test_bad_audio_is_a_clear_400_and_the_encoder_holds_nothing(family):
    """A clip that is not audio, one whose header lies, and (straight to the encoder, past the
    gateway's checks) a clip cut after 8 samples, an image sent to an audio model and an Encode mixing
    modalities: each refused with what was wrong; the services answer the next good request and the
    encoder's pool holds nothing."""
    import grpc

    from epd.encoder.v1 import encoder_pb2, encoder_pb2_grpc

    _, dep, reference, _, _ = family
    for data, needle in [(b"hello there, not audio", "not a recognised audio file"),
                         (b"RIFF\x24\x00\x00\x00WAVEfmt " + bytes(8), "header cannot be read")]:
        body = {"messages": [{"role": "user", "content": [
            {"type": "input_audio", "input_audio": {"data": base64.b64encode(data).decode(), "format": "wav"}}]}]}
        status, out = post(dep.url + "/v1/chat/completions", body)
        assert status == 400 and out["error"]["param"] == "audio_url" and needle in out["error"]["message"], out
    wav = make_audio(5, 0.5)
    with dep.client_security.channel(dep.encoder_addr) as ch:
        stub = encoder_pb2_grpc.EncoderServiceStub(ch)
        for items, needle in [
            ([encoder_pb2.MediaItem(modality="audio", data=wav[:60])], "too short to be represented"),  # 8 samples
            ([encoder_pb2.MediaItem(modality="image", data=make_image(1))], "modality 'image' is not encoded here"),
            ([encoder_pb2.MediaItem(modality="audio", data=wav), encoder_pb2.MediaItem(modality="video", data=wav)],
             "not encoded here"),
        ]:
            with pytest.raises(grpc.RpcError) as e:
                list(stub.Encode(encoder_pb2.EncodeRequest(request_id="bad-audio", items=items), timeout=30))
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and needle in e.value.details(), e.value
    body = dict(AUDIO_REQUESTS["one"])
    status, out = post(dep.url + "/v1/chat/completions", body, 120)
    assert status == 200 and out["choices"][0]["token_ids"] == reference["one"]
    assert settled(lambda: sum(producer_stats(dep)[k] for k in ("items_held", "pending_reservations")), 0) == 0
