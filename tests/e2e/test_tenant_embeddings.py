"""Client keys end to end, and each tenant's embeddings its own: a second gateway with a keys file (two
tenants) on the session deployment's encoder and LM refuses a request without a key, and the same image
sent by tenant a, then b, then a again is encoded and transferred for a, again for b (another tenant's
item, never served from a's), and not at all for a's second send (its own item, in the encoder's and the
LM's caches); every answer is the same tokens."""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.request
from types import SimpleNamespace

import pytest

from services.probe import http_ok
from services.up import Service, free_port, wait_ready
from tests.e2e.helpers import encodes_done, image_chat, metric, settled, wait_admitted

pytestmark = pytest.mark.e2e

KEYS = {"a": "sk-e2e-tenant-a-71c3", "b": "sk-e2e-tenant-b-0d9e"}


@pytest.fixture(scope="module")
def keyed(deployment, tmp_path_factory):
    """The keyed gateway (no engine of its own: the session's encoder and LM), with the session's metrics
    ports for the engines' counters."""
    keys = tmp_path_factory.mktemp("keys") / "keys.jsonl"
    keys.write_text("".join(json.dumps({"tenant": t, "key": k}) + "\n" for t, k in KEYS.items()))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    svc = Service("gateway-keyed", ["gateway", "--epd-facts", "--host", "127.0.0.1", "--port", str(port),
                                    "--encoders", deployment.encoder_addr, "--lms", deployment.lm_addr,
                                    "--api-keys-file", str(keys), *deployment.security_args],
                  os.path.join(deployment.log_dir, "gateway-keyed.log"))
    svc.start(dict(os.environ, PYTHONUNBUFFERED="1"))
    try:
        wait_ready({svc: lambda: http_ok(url + "/health")}, time.monotonic() + 120, poll_s=0.3)
        wait_admitted(port, [deployment.encoder_addr], [deployment.lm_addr])
        yield SimpleNamespace(url=url, gateway_metrics=port, encoder_metrics=deployment.encoder_metrics,
                              lm_metrics=deployment.lm_metrics)
    finally:
        svc.stop()


def _post(dep, body: dict, key: str | None) -> tuple[int, dict]:
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    req = urllib.request.Request(dep.url + "/v1/chat/completions", data=json.dumps(body).encode(), headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _counters(dep) -> tuple[float, float, float]:
    return (metric(dep.encoder_metrics, "epd_encoder_vision_runs_total"),
            metric(dep.lm_metrics, "epd_lm_transferred_items_total"),
            metric(dep.lm_metrics, "epd_lm_local_encoder_runs_total"))


def test_two_tenants_sending_one_image_each_encode_it_and_a_tenants_second_send_reuses_its_own(keyed):
    body = image_chat(3100)
    status, _ = _post(keyed, body, None)
    assert status == 401
    encodes_done(keyed)
    runs, moved, local = _counters(keyed)
    answers = []
    for n, (tenant, want) in enumerate((("a", (1, 1)), ("b", (2, 2)), ("a", (2, 2)))):
        status, answer = _post(keyed, body, KEYS[tenant])
        assert status == 200, answer
        answers.append(answer)
        expected = (runs + want[0], moved + want[1], local)
        assert settled(lambda: _counters(keyed), expected) == expected, f"send {n} (tenant {tenant})"
    assert answers[2]["epd"]["transferred_items"] == 0  # a's own item: in the LM's caches
    assert answers[1]["epd"]["transferred_items"] == 1  # a's image, but b's item: encoded and moved for b
    tokens = [a["choices"][0]["token_ids"] for a in answers]
    assert tokens[0] == tokens[1] == tokens[2] and tokens[0]
