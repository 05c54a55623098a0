"""docs/protocol.md's error tables say what services/gateway/core.py's one table does."""

import os
import re

import grpc
import pytest

from services.gateway.errors import grpc_code, http_status

pytestmark = pytest.mark.unit

DOC = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "protocol.md")


def _doc() -> str:
    with open(DOC) as f:
        return f.read()


def test_the_grpc_to_http_table_is_the_cores():
    text = _doc()
    table = text[text.index("| gRPC status | HTTP | `type` |"):]
    rows = [line for line in table.splitlines()[2:] if line.startswith("|")]
    seen = 0
    for line in rows:
        codes_cell, status, type_ = (c.strip() for c in line.strip("|").split("|"))
        for name in re.findall(r"`([A-Z_]+)`", codes_cell):
            code = getattr(grpc.StatusCode, name, None)
            if code is None:
                continue
            assert http_status(code) == (int(status), type_.strip("`")), line
            seen += 1
        if codes_cell == "anything else":
            assert http_status(grpc.StatusCode.DATA_LOSS) == (int(status), type_.strip("`"))
    assert seen >= 10


def test_the_http_to_grpc_sentence_is_the_cores():
    text = _doc()
    sentence = " ".join(text[text.index("HTTP to gRPC"):text.index("against `errors.STATUS`")].split())
    pairs = [(status, name) for statuses, name in re.findall(r"((?:\d{3}(?: and |, )?)+) `([A-Z_]+)`", sentence)
             for status in re.findall(r"\d{3}", statuses)]
    assert len(pairs) == 11, pairs
    for status, name in pairs:
        assert grpc_code(int(status)) == getattr(grpc.StatusCode, name), (status, name)
    assert "anything else `INTERNAL`" in sentence and grpc_code(418) == grpc.StatusCode.INTERNAL
