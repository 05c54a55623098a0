"""bench/gateway.py and bench/gateway_arms.py: which gateways one run compares (workers, the state store),
how their paths are labelled, and what is read from the rows: the throughput at an added p99 and what
the store adds (no servers: the benchmark itself runs by hand, see docs/benchmarks.md)."""

from __future__ import annotations

import pytest

from tests.unit.helpers import load_bench

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def arms():
    return load_bench("gateway_arms")


@pytest.fixture(scope="module")
def gateway():
    return load_bench("gateway")


def row(gw, path, c, p50, p99, added_p99, rps, tokens=16):
    return {"gateway": gw, "path": path, "concurrency": c, "max_tokens": tokens, "p50_us": p50, "p99_us": p99,
            "added_p99_us": added_p99, "rps": rps}


def test_each_worker_count_and_store_is_one_arm_and_workers_always_share_through_their_own(arms):
    got = arms.arms([1, 2], ["none", "private"])
    assert [a.label for a in got] == ["w1", "w1+store", "w2"]
    assert [a.store for a in got] == ["none", "private", "workers"]


def test_only_the_private_store_arm_names_a_store(arms):
    assert arms.Arm(1, "private").store_flags("unix:///s", "/p") == [
        "--state-store", "unix:///s", "--state-store-password-file", "/p"]
    assert arms.Arm(1, "none").store_flags("unix:///s", "/p") == []
    assert arms.Arm(2, "workers").store_flags("unix:///s", "/p") == []


@pytest.mark.parametrize("workers, stores", [([0], ["none"]), ([1], ["redis"])])
def test_arms_that_cannot_run_are_refused(arms, workers, stores):
    with pytest.raises(ValueError):
        arms.arms(workers, stores)


def test_labels_name_the_arm_of_gateway_paths_only(arms):
    assert arms.label("rest", arms.Arm(2, "workers")) == "rest@w2"
    assert arms.split_label("rest@w1+store") == ("rest", "w1+store")
    assert arms.split_label("direct") == ("direct", None)


def test_throughput_is_the_most_requests_per_second_within_the_added_p99(arms):
    rows = [row("w1", "rest", 1, 1e3, 2e3, 1e3, 500.0), row("w1", "rest", 16, 2e4, 4e4, 30e3, 900.0),
            row("w1", "rest", 64, 6e4, 9e4, 70e3, 950.0), row("w2", "rest", 1, 1e3, 2e3, 60e3, 400.0),
            row(None, "direct", 1, 5e2, 1e3, None, 2000.0)]
    got = {f["gateway"]: f for f in arms.frontier(rows, limit_us=50e3)}
    assert set(got) == {"w1", "w2"}
    assert (got["w1"]["rps"], got["w1"]["concurrency"]) == (900.0, 16)
    assert got["w1"]["added_p99_ms"] == {1: 1.0, 16: 30.0, 64: 70.0}
    assert got["w2"]["rps"] is None and got["w2"]["concurrency"] is None


def test_store_cost_is_the_difference_to_the_arm_without_it_at_the_same_cell(arms):
    rows = [row("w1", "rest", 1, 1000.0, 2000.0, 0, 1), row("w1+store", "rest", 1, 1250.0, 2600.0, 0, 1),
            row("w1+store", "rest", 4, 1.0, 1.0, 0, 1), row("w2", "rest", 1, 900.0, 1900.0, 0, 1)]
    assert arms.store_cost(rows) == [{"path": "rest", "max_tokens": 16, "concurrency": 1, "p50_us": 250.0,
                                      "p99_us": 600.0}]


def test_a_rows_cpu_columns_are_the_client_the_lm_and_its_own_gateway_and_store(gateway):
    cpu = {"client": 1.0, "stub-lm": 2.0, "gateway-w1": 3.0, "gateway-w2": 4.0, "store-w2": 5.0}
    assert gateway.cpu_columns({"gateway": "w2", "cpu_us_per_req": cpu}) == [1.0, 2.0, 4.0, 5.0]
    assert gateway.cpu_columns({"gateway": "w1", "cpu_us_per_req": cpu}) == [1.0, 2.0, 3.0]
    assert gateway.cpu_columns({"gateway": None, "cpu_us_per_req": cpu}) == [1.0, 2.0]
    one = {"client": 1.0, "stub-lm": 2.0, "gateway": 3.0}  # a run of one gateway
    assert gateway.cpu_columns({"gateway": "w1", "cpu_us_per_req": one}) == [1.0, 2.0, 3.0]
