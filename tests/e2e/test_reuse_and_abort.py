"""Issue 4 must-show: reuse (a repeated image is encoded once and, with its
prefix cached, transferred once) and a client that disconnects mid-stream
releases what it held."""

from __future__ import annotations

import json
import os
import socket
import time

import pytest

from tests.e2e.conftest import REFERENCE_REQUESTS
from tests.e2e.helpers import encodes_done, image_chat, metric, post, producer_stats, settled

pytestmark = pytest.mark.e2e


def _counters(dep) -> tuple[float, float, float]:
    return (metric(dep.encoder_metrics, "epd_encoder_vision_runs_total"),
            metric(dep.lm_metrics, "epd_lm_transferred_items_total"),
            metric(dep.lm_metrics, "epd_lm_local_encoder_runs_total"))



def test_reuse_same_image_is_encoded_once_and_transferred_once(deployment, reference):
    url = deployment.url + "/v1/chat/completions"
    encodes_done(deployment)  # an earlier test's vision run is counted before the baseline, not after it
    runs0, moved0, local0 = _counters(deployment)
    status, first = post(url, REFERENCE_REQUESTS["reuse"])
    assert status == 200 and first["choices"][0]["token_ids"] == reference["reuse"]
    assert settled(lambda: _counters(deployment), (runs0 + 1, moved0 + 1, local0)) == (runs0 + 1, moved0 + 1, local0)

    status, second = post(url, REFERENCE_REQUESTS["reuse"])  # same image, same prompt prefix
    assert status == 200 and second["choices"][0]["token_ids"] == reference["reuse"]
    assert _counters(deployment) == (runs0 + 1, moved0 + 1, local0)  # no second encode, no transfer
    assert second["epd"]["transferred_items"] == 0


def _stream_and_hang_up(deployment, seed: int) -> None:
    """Starts a long streamed image chat, reads its first event, stops reading, then hangs up.

    The stream is megabytes (8 choices of 900 tokens, each token with 20 logprobs) and the
    client's receive window is 4 KiB: once the socket, the gateway's write buffer and the gRPC
    window between gateway and LM are full, the LM's answer waits on the client. So the LM call
    is still open when the client goes away, however fast or slow each process runs (a short
    stream could be over before a busy client got its first event, and then there is nothing
    to abort)."""
    # ignore_eos: every choice decodes its 900 tokens (a random model may end at once on some
    # images); several choices need sampling (vLLM refuses n > 1 with greedy).
    body = json.dumps(dict(image_chat(seed, max_tokens=900), stream=True, ignore_eos=True, n=8,
                           temperature=1.0, seed=seed, logprobs=True, top_logprobs=20)).encode()
    host, port = deployment.url.removeprefix("http://").rsplit(":", 1)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect: the window stays small
        sock.settimeout(60)
        sock.connect((host, int(port)))
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(body) + body)
        seen = b""
        while b"data: " not in seen:  # the stream started
            chunk = sock.recv(4096)
            assert chunk and not (seen + chunk).startswith(b"HTTP/1.1 4"), seen + chunk
            seen += chunk
        time.sleep(0.5)  # not reading: the buffers on the way fill up
        sock.shutdown(socket.SHUT_RDWR)


def _log_lines(deployment, needle: str) -> list[str]:
    with open(os.path.join(deployment.log_dir, "gateway.log"), errors="replace") as f:
        return [line.strip() for line in f if needle in line][-6:]


def test_abort_client_disconnecting_mid_stream_releases_everything(deployment):
    # The client holds the stream back (``_stream_and_hang_up``), so the LM is still answering
    # when the gateway notices the client is gone. Should the buffers on the way ever hold a whole
    # answer, the LM finishes first and there was nothing to abort: the scenario is tried again
    # with a fresh image (and nothing may stay held either way).
    tries = []
    # Images no other test sends (1003 is the trust-boundary test's victim, which must be new to it).
    for seed in (1005, 1006, 1007):
        cancelled = metric(deployment.lm_metrics, "epd_lm_requests_total", status="cancelled")
        done = metric(deployment.lm_metrics, "epd_lm_requests_total", status="ok")
        t0 = time.monotonic()
        _stream_and_hang_up(deployment, seed)
        hung_up = time.monotonic()
        deadline = time.monotonic() + 60  # left at once when it settles; a loaded host may take seconds
        while time.monotonic() < deadline:
            stats = producer_stats(deployment)
            gone = metric(deployment.lm_metrics, "epd_lm_requests_total", status="cancelled") > cancelled
            finished = metric(deployment.lm_metrics, "epd_lm_requests_total", status="ok") > done
            if (gone or finished) and stats["items_held"] == 0 and stats["reserved_bytes"] == 0:
                break
            time.sleep(0.2)
        tries.append(dict(seed=seed, first_event_s=round(hung_up - t0, 3), waited_s=round(time.monotonic() - hung_up, 3),
                          lm_status={k: metric(deployment.lm_metrics, "epd_lm_requests_total", status=k)
                                     for k in ("ok", "cancelled", "error")}))
        # Either way nothing stays held, on either side.
        assert stats["reserved_bytes"] == 0 and stats["pending_reservations"] == 0 and stats["items_held"] == 0, stats
        # The LM's gauges are its engine's last step's snapshot: they can trail the producer's Stats.
        assert settled(lambda: metric(deployment.lm_metrics, "epd_ec_reserved_bytes", role="consumer"), 0) == 0
        assert settled(lambda: metric(deployment.lm_metrics, "epd_ec_pending_reservations", role="consumer"), 0) == 0
        if gone:
            break
    assert gone, ("in three tries the gateway never cancelled an LM call still streaming", tries,
                  _log_lines(deployment, "went away"))
    status, _ = post(deployment.url + "/v1/chat/completions", REFERENCE_REQUESTS["image0"])
    assert status == 200
