"""Issues 25 and 35: an encoder-decoder speech model (the tiny offline Whisper) through epd-serve answers
/v1/audio/transcriptions and /v1/audio/translations as ``vllm serve`` does on the same model: each
response_format vLLM accepts (and the ones it refuses, refused the same way), streaming, two clips, a
clip longer than one 30 s window (vLLM splits it), language detection, and bad uploads. The encoder is
apart (issue 35, docs/design.md "Encoder-decoder models"): the encoder service cuts each upload into the
windows vLLM cuts and encodes them, and the LM's decoder takes each window's output over the transfer
(its own encoder runs only for a language-detection call); the perturbation shows the outputs are used.

One deployment (gateway + encoder + LM, with the test-only hooks) and one ``vllm serve`` for the module,
started side by side."""

from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx
import pytest

from epd.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from services.cli import default_model
from services.up import Deployment
from tests import ahead
from tests.e2e.conftest import stop_in_background
from tests.e2e.helpers import TEARDOWN_DRAIN_S, metric, perturbable, settled, vllm_serve
from tools.media import make_audio

pytestmark = pytest.mark.e2e

ROUTES = ("/v1/audio/transcriptions", "/v1/audio/translations")
CLIP_A = make_audio(seed=1, seconds=2.0)
CLIP_B = make_audio(seed=2, seconds=3.0)
LONG = make_audio(seed=3, seconds=45.0)  # longer than Whisper's 30 s window: vLLM splits it
MAX_S = 60


@pytest.fixture(scope="module")
def whisper() -> str:
    return default_model(family="whisper")


def _deployment() -> Deployment:
    # One decode bound for both (a minute, so that a clip past it stays small): the LM's flag, vLLM's variable.
    bound = ["--max-audio-seconds", str(MAX_S)]
    return perturbable(Deployment(model=default_model(family="whisper"), quiet=True, drain_grace_s=TEARDOWN_DRAIN_S,
                                  lm_args=bound, encoder_args=bound))


ahead.register(__name__, "pair", _deployment)


@pytest.fixture(scope="module")
def pair(whisper, tmp_path_factory):
    """(epd-serve's gateway URL, the deployment, vllm serve's URL) on the tiny Whisper."""
    ready = ahead.take(__name__)
    dep = ready or _deployment()
    with ThreadPoolExecutor(1) as pool:
        started = pool.submit(lambda: ready or dep.start())
        with vllm_serve(whisper, tmp_path_factory.mktemp("vllm-serve-whisper") / "server.log",
                        env={"VLLM_MAX_AUDIO_DECODE_DURATION_S": str(MAX_S)}) as ref:
            started.result()
            try:
                yield dep.url, dep, ref
            finally:
                stop_in_background(dep)


def _post(url: str, route: str, clip: bytes, filename: str = "clip.wav", **fields) -> httpx.Response:
    data = {k: (json.dumps(v) if isinstance(v, bool) else str(v)) for k, v in fields.items()}
    return httpx.post(url + route, files={"file": (filename, clip, "audio/wav")}, data=data, timeout=120)


def _same(a: httpx.Response, b: httpx.Response) -> None:
    """Equal status, content type and body; JSON compared without epd-serve's ``epd`` object."""
    assert a.status_code == b.status_code, (a.status_code, a.text[:500], b.status_code, b.text[:500])
    ta, tb = a.headers.get("content-type", ""), b.headers.get("content-type", "")
    assert ta.split(";")[0] == tb.split(";")[0], (ta, tb)
    if ta.startswith("application/json"):
        ja, jb = a.json(), b.json()
        if isinstance(ja, dict):
            ja.pop("epd", None)
        assert ja == jb
    else:
        assert a.text == b.text


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("fmt", ["json", "text", "verbose_json", "srt", "vtt"])
def test_each_response_format_as_vllm_serve_answers_it(pair, route, fmt):
    epd, _, ref = pair
    fields = dict(model=default_model(family="whisper"), language="en", temperature=0, response_format=fmt)
    ours = _post(epd, route, CLIP_A, **fields)
    _same(ours, _post(ref, route, CLIP_A, **fields))
    # vLLM 0.32 answers json, text and verbose_json, and refuses srt and vtt (400): so does epd-serve.
    assert ours.status_code == (400 if fmt in ("srt", "vtt") else 200), ours.text[:300]


def test_two_clips_give_their_own_texts_and_a_long_clip_is_split_as_vllm_splits_it(pair):
    epd, _, ref = pair
    texts = []
    for clip in (CLIP_A, CLIP_B, LONG):
        fields = dict(model=default_model(family="whisper"), language="en", temperature=0)
        ours = _post(epd, ROUTES[0], clip, **fields)
        _same(ours, _post(ref, ROUTES[0], clip, **fields))
        texts.append(ours.json()["text"])
    assert texts[0] != texts[1], "the tiny Whisper's text depends on the audio"


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("clip", [("WAV", 8000, 1), ("WAV", 48000, 2), ("FLAC", 44100, 2), ("MP3", 44100, 1),
                                  ("OGG", 48000, 1)], ids=lambda c: f"{c[0].lower()}-{c[1] // 1000}k-{c[2]}ch")
def test_audio_at_the_rates_and_in_the_formats_people_record_as_vllm_serve(pair, route, clip):
    """Issue 35: 8-48 kHz, mono or stereo, WAV/FLAC/MP3/OGG. vLLM decodes and resamples them to Whisper's
    16 kHz with PyAV (its ``audio`` extra, in this project's install): the same text as ``vllm serve``."""
    epd, _, ref = pair
    fmt, rate, channels = clip
    data = make_audio(seed=6, seconds=2.0, rate=rate, fmt=fmt, channels=channels)
    name = f"clip.{fmt.lower()}"
    fields = dict(model=default_model(family="whisper"), language="en", temperature=0)
    ours = _post(epd, route, data, filename=name, **fields)
    _same(ours, _post(ref, route, data, filename=name, **fields))
    assert ours.status_code == 200 and ours.json()["text"], ours.text[:300]


def test_language_detection_a_prompt_and_timestamp_granularities_as_vllm_serve(pair):
    epd, _, ref = pair
    for fields in (dict(temperature=0), dict(language="en", prompt="hello there", temperature=0),
                   {"language": "en", "temperature": 0, "response_format": "verbose_json",
                    "timestamp_granularities[]": "segment"}):
        fields["model"] = default_model(family="whisper")
        ours = _post(epd, ROUTES[0], CLIP_B, **fields)
        _same(ours, _post(ref, ROUTES[0], CLIP_B, **fields))
        assert ours.status_code == 200 and "text" in ours.json(), ours.text[:300]


def _events(r: httpx.Response) -> list[dict]:
    out = []
    for line in r.text.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            event = json.loads(line[len("data: "):])
            event.pop("id", None)
            event.pop("created", None)
            out.append(event)
    return out


def test_streaming_as_vllm_serve_streams(pair):
    epd, _, ref = pair
    fields = dict(model=default_model(family="whisper"), language="en", temperature=0, stream=True,
                  stream_include_usage=True)
    ours, theirs = _post(epd, ROUTES[0], CLIP_A, **fields), _post(ref, ROUTES[0], CLIP_A, **fields)
    assert ours.status_code == theirs.status_code == 200
    assert ours.headers["content-type"].startswith("text/event-stream")
    # How many tokens one chunk carries depends on when the server reads the engine's output (vLLM's
    # own stream coalesces differently from run to run): the streamed text and the usage must agree.
    assert _streamed(ours) == _streamed(theirs) and _streamed(ours)[0]


def _streamed(r: httpx.Response) -> tuple[str, list[dict], set[str]]:
    """The concatenated text of a transcription stream, its usage chunks, and the other keys seen."""
    text, usage, shape = "", [], set()
    for event in _events(r):
        shape.add(event.get("object", ""))
        for choice in event.get("choices", []):
            text += choice.get("delta", {}).get("content") or ""
        if event.get("usage"):
            usage.append(event["usage"])
    return text, usage, shape


@pytest.mark.parametrize("case", ["not audio", "empty file", "not multipart", "no file", "unknown model", "too long"])
def test_bad_uploads_are_refused_as_vllm_serve_refuses_them(pair, case):
    epd, _, ref = pair
    model = default_model(family="whisper")
    if case == "not multipart":
        def send(url):
            return httpx.post(url + ROUTES[0], json={"model": model}, timeout=60)
    elif case == "too long":
        clip = make_audio(seed=4, seconds=MAX_S + 5)

        def send(url):
            return _post(url, ROUTES[0], clip, model=model)
    elif case == "unknown model":
        def send(url):
            return _post(url, ROUTES[0], CLIP_A, model="not-the-served-model")
    elif case == "no file":
        def send(url):
            return httpx.post(url + ROUTES[0], data={"model": model}, files={"other": ("x", b"x")}, timeout=60)
    else:
        clip = b"this is not a sound file at all" * 40 if case == "not audio" else b""

        def send(url):
            return _post(url, ROUTES[0], clip, model=model)
    ours, theirs = send(epd), send(ref)
    assert ours.status_code // 100 == theirs.status_code // 100 == 4, (ours.text[:300], theirs.text[:300])
    assert ours.json()["error"]["message"] == theirs.json()["error"]["message"]
    ok = _post(epd, ROUTES[0], CLIP_A, model=model, language="en", temperature=0)
    assert ok.status_code == 200  # the services still answer


def _counts(dep) -> dict[str, float]:
    return {"encoder items": metric(dep.encoder_metrics, "epd_encoder_items_total"),
            "encoder runs": metric(dep.encoder_metrics, "epd_encoder_vision_runs_total"),
            "lm local runs": metric(dep.lm_metrics, "epd_lm_local_encoder_runs_total"),
            "lm transferred": metric(dep.lm_metrics, "epd_lm_transferred_items_total")}


def _grew(dep, before: dict[str, float], **want: float) -> None:
    """The counters grew by ``want`` (keys with spaces as underscores) once the encoder has counted."""
    want = {k.replace("_", " "): v for k, v in want.items()}
    settled(lambda: _counts(dep)["encoder runs"] - before["encoder runs"], want["encoder runs"])
    now = _counts(dep)
    assert {k: now[k] - before[k] for k in want} == want, (now, before)


def test_each_window_is_encoded_apart_and_a_repeated_clip_is_encoded_once(pair):
    """Issue 35: the encoder cuts an upload into the windows vLLM cuts, one item each (a 45 s clip: two),
    and the LM's decoder takes them over the transfer: its own encoder never runs. The same clip again
    is served from the encoder's store (no encoder run); the answers are `vllm serve`'s throughout."""
    epd, dep, ref = pair
    fields = dict(model=default_model(family="whisper"), language="en", temperature=0)
    short, long = make_audio(seed=11, seconds=2.0), make_audio(seed=12, seconds=45.0)  # new to the encoder
    for clip, windows, runs in ((short, 1, 1), (long, 2, 2), (long, 2, 0)):
        before = _counts(dep)
        ours = _post(epd, ROUTES[1], clip, **fields)
        _same(ours, _post(ref, ROUTES[1], clip, **fields))
        assert ours.status_code == 200 and ours.json()["epd"]["transferred_items"] == windows, ours.text[:500]
        _grew(dep, before, encoder_items=windows, encoder_runs=runs, lm_local_runs=0, lm_transferred=windows)


def test_language_detection_reads_the_first_window_on_the_lm(pair):
    """Without a language vLLM's serving first asks the model for one, from the first window, in an engine
    call of its own: the LM encodes that window itself (one local run); the transcription's windows still
    come from the encoder. The answer is `vllm serve`'s."""
    epd, dep, ref = pair
    fields = dict(model=default_model(family="whisper"), temperature=0)
    clip = make_audio(seed=7, seconds=2.5)
    before = _counts(dep)
    ours = _post(epd, ROUTES[0], clip, **fields)
    _same(ours, _post(ref, ROUTES[0], clip, **fields))
    _grew(dep, before, encoder_items=1, encoder_runs=1, lm_local_runs=1, lm_transferred=1)


def test_encoder_outputs_changed_in_transit_change_the_text(pair):
    """The perturbation technique (tests/e2e/perturb): with the LM's connector negating and scaling every
    output it injects, the text is no longer `vllm serve`'s, each window went through the hook, and the
    LM's encoder never ran: the decoder reads the transferred outputs, not a local encode."""
    epd, dep, ref = pair
    fields = dict(model=default_model(family="whisper"), language="en", temperature=0)
    clip = make_audio(seed=8, seconds=3.0)
    plain = _post(ref, ROUTES[0], clip, **fields).json()["text"]
    switch, log = f"{dep.log_dir}/perturb-on", f"{dep.log_dir}/perturbed.txt"
    seen = open(log).read().split() if os.path.exists(log) else []
    before = _counts(dep)
    open(switch, "w").close()
    try:
        ours = _post(epd, ROUTES[0], clip, **fields)
    finally:
        os.remove(switch)
    assert ours.status_code == 200, ours.text[:300]
    assert len(open(log).read().split()) == len(seen) + 1  # the one window went through the hook
    assert ours.json()["text"] != plain, plain
    _grew(dep, before, encoder_items=1, encoder_runs=1, lm_local_runs=0, lm_transferred=1)
    again = _post(epd, ROUTES[0], clip, **fields)  # the hook off: the stored output, plain vLLM's text
    assert again.json()["text"] == plain


def test_too_big_an_upload_is_refused_as_vllm_serve_refuses_it(pair):
    """Past vLLM's upload bound (VLLM_MAX_AUDIO_CLIP_FILESIZE_MB, 25 MB) vLLM's app on the LM refuses it
    as `vllm serve` does; past the gateway's body bound (the largest media item base64-encoded plus
    1 MiB, far above) the gateway answers 413 before reading it (tests/integration/test_intake.py)."""
    epd, _, ref = pair
    big = b"RIFF" + bytes(30 << 20)
    ours = _post(epd, ROUTES[0], big, model=default_model(family="whisper"))
    _same(ours, _post(ref, ROUTES[0], big, model=default_model(family="whisper")))
    assert ours.status_code == 400 and "Maximum file size exceeded" in ours.json()["error"]["message"]


def test_the_native_grpc_api_answers_as_rest_does(pair):
    """Transcription / Translation RPCs: the form's fields as JSON, the clip as media[0]."""
    epd, dep, _ = pair
    fields = dict(model=default_model(family="whisper"), language="en", temperature=0)
    for route, method in zip(ROUTES, ("Transcription", "Translation")):
        rest = _post(epd, route, CLIP_B, **fields).json()
        rest.pop("epd", None)
        req = gateway_pb2.OpenAIRequest(body=json.dumps(fields).encode(), media=[CLIP_B])
        with grpc.insecure_channel(dep.gateway_grpc) as ch:
            out = list(getattr(gateway_pb2_grpc.GatewayServiceStub(ch), method)(req, timeout=60))
        assert [json.loads(m.body) for m in out if m.body] == [rest]

