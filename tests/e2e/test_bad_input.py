"""Issue 2 must-show: bad input gets a 4xx with a message; nothing goes down."""

from __future__ import annotations

import base64

import pytest

from tests.e2e.conftest import REFERENCE_REQUESTS
from tests.e2e.helpers import post

pytestmark = pytest.mark.e2e


def _with_url(url: str) -> dict:
    return {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                      {"type": "text", "text": "hi"}]}], "max_tokens": 4}


CASES = {
    "undecodable image": _with_url("data:image/png;base64," + base64.b64encode(b"\x89PNG not really").decode()),
    "non-image data URL": _with_url("data:text/plain;base64," + base64.b64encode(b"hello").decode()),
    "malformed JSON": b'{"messages": [',
    "missing messages": {"model": "x", "max_tokens": 4},
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_is_a_4xx_with_a_message_and_the_next_request_succeeds(deployment, reference, case):
    status, body = post(deployment.url + "/v1/chat/completions", CASES[case])
    assert 400 <= status < 500, (status, body)
    assert body["error"]["message"]
    status, body = post(deployment.url + "/v1/chat/completions", REFERENCE_REQUESTS["image0"])
    assert status == 200, body
    assert body["choices"][0]["token_ids"] == reference["image0"]
