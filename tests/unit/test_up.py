"""services.up helpers that need no engine."""

from __future__ import annotations

import random
import socket

from services.up import _ephemeral_low, free_port


def test_free_ports_are_distinct_bindable_and_outside_the_ephemeral_range():
    random.seed(0)  # a test that seeds the global generator does not make ports repeat
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == 50
    low = _ephemeral_low()
    assert all(1024 <= p < low for p in ports)
    for p in ports[:5]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))
