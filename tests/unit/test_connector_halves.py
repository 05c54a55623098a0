"""Each connector half offers what its Protocol (``ectransfer.connector.halves``) names, with the
same parameters: the facade calls nothing else (issue 14)."""

from __future__ import annotations

import inspect

import pytest

from ectransfer.connector import halves
from ectransfer.connector.consumer import ConsumerScheduler, ConsumerWorker
from ectransfer.connector.producer import ProducerScheduler, ProducerWorker

pytestmark = pytest.mark.unit


def _members(proto) -> dict[str, inspect.Signature]:
    out = {}
    for klass in reversed(proto.__mro__):
        if klass in (object,) or not getattr(klass, "_is_protocol", False):
            continue
        for name, fn in vars(klass).items():
            if inspect.isfunction(fn) and not name.startswith("_"):
                out[name] = inspect.signature(fn)
    return out


@pytest.mark.parametrize("cls, proto", [
    (ProducerScheduler, halves.SchedulerHalf),
    (ConsumerScheduler, halves.SchedulerHalf),
    (ProducerWorker, halves.ProducerWorkerHalf),
    (ConsumerWorker, halves.ConsumerWorkerHalf),
])
def test_each_half_implements_its_protocol(cls, proto):
    members = _members(proto)
    assert members
    for name, sig in members.items():
        impl = getattr(cls, name, None)
        assert impl is not None, f"{cls.__name__} lacks {name}"
        assert list(inspect.signature(impl).parameters) == list(sig.parameters), (cls.__name__, name)


def test_the_facade_reaches_the_halves_only_through_the_protocols():
    from ectransfer.connector import facade

    src = inspect.getsource(facade)
    assert "getattr(self._" not in src and "_half" not in src
