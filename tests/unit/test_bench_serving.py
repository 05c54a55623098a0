"""bench/serving.py builds each system's processes for the device it runs on:
disjoint cores on CPU, one GPU shared by memory slices on cuda (not run here:
no GPU; this checks what it would start)."""

from __future__ import annotations

import json
import os
import sys

import pytest

from tests.unit.helpers import load_bench

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def serving():
    return load_bench("serving")
    sys.modules.pop("bench_serving", None)


def _flag(args: list[str], name: str):
    return args[args.index(name) + 1] if name in args else None


@pytest.mark.parametrize("name", ["colocated", "colocated-dp2", "epd", "epd-auto", "vllm-ec", "epd-pd", "vllm-epd"])
def test_cuda_systems_share_one_gpu_by_memory_slices_not_cores(serving, tmp_path, name):
    system = serving.System(name, "/models/m", [0, 1, 2, 3], str(tmp_path), json.dumps({"max_num_seqs": 64}),
                            device="cuda")
    shares = []
    for svc, _ in system.engines:
        if name in ("vllm-ec", "vllm-epd"):
            assert "--kv-cache-memory-bytes" not in svc.argv  # vLLM sizes KV from the slice
            assert "VLLM_CPU_OMP_THREADS_BIND" not in svc.extra_env
            shares.append(float(_flag(svc.argv, "--gpu-memory-utilization")))
            assert _flag(svc.argv, "--max-num-seqs") is not None
        else:
            assert "--cpu-cores" not in svc.argv and _flag(svc.argv, "--kv-cache-bytes") == "0"
            engine = json.loads(_flag(svc.argv, "--vllm-args"))
            assert engine["max_num_seqs"] == 64  # the caller's arguments are kept
            shares.append(engine["gpu_memory_utilization"])
    assert 0 < sum(shares) <= 0.9 and len(shares) == len(system.engines)


def test_cpu_systems_split_cores_and_keep_the_fixed_kv_cache(serving, tmp_path):
    system = serving.System("epd", "/models/m", [0, 1, 2, 3], str(tmp_path), "{}")
    cores = [_flag(svc.argv, "--cpu-cores") for svc, _ in system.engines]
    assert cores == ["0,1", "2,3"]
    assert all("gpu_memory_utilization" not in _flag(svc.argv, "--vllm-args") for svc, _ in system.engines)


def test_an_unknown_device_is_refused(serving, tmp_path):
    with pytest.raises(ValueError, match="cpu or cuda"):
        serving.System("epd", "/models/m", [0], str(tmp_path), "{}", device="tpu")


def test_epd_auto_is_epd_with_the_gateways_auto_placement(serving, tmp_path):
    auto = serving.System("epd-auto", "/models/m", [0, 1], str(tmp_path), "{}")
    plain = serving.System("epd", "/models/m", [0, 1], str(tmp_path), "{}")
    assert _flag(auto.front.argv, "--placement") == "auto" and _flag(plain.front.argv, "--placement") == "encoder"


@pytest.mark.parametrize("cores, want", [([0, 1], ["0", "0", "1"]), ([0, 1, 2, 3], ["0,1", "2", "3"])])
def test_e_p_d_systems_place_their_three_engines_alike_and_vllms_follows_upstreams_1e1p1d(serving, tmp_path,
                                                                                          cores, want):
    ours = serving.System("epd-pd", "/models/m", cores, str(tmp_path), "{}")
    assert [_flag(svc.argv, "--cpu-cores") for svc, _ in ours.engines] == want
    assert [_flag(svc.argv, "--role") for svc, _ in ours.engines] == [None, "prefill", "decode"]
    assert _flag(ours.front.argv, "--lms").count(",") == 1
    vllm = serving.System("vllm-epd", "/models/m", cores, str(tmp_path), "{}")
    assert [svc.extra_env["VLLM_CPU_OMP_THREADS_BIND"] for svc, _ in vllm.engines] == want
    (e, _), (p, _), (d, _) = vllm.engines
    assert json.loads(_flag(e.argv, "--ec-transfer-config"))["ec_role"] == "ec_producer"
    assert "--kv-transfer-config" not in e.argv
    assert json.loads(_flag(p.argv, "--ec-transfer-config"))["ec_role"] == "ec_consumer"
    assert json.loads(_flag(p.argv, "--kv-transfer-config"))["kv_role"] == "kv_producer"
    assert "--ec-transfer-config" not in d.argv  # upstream's decode server runs no EC connector
    kv = json.loads(_flag(d.argv, "--kv-transfer-config"))
    assert kv["kv_role"] == "kv_consumer" and kv["kv_buffer_device"] == "cpu"
    assert p.extra_env["VLLM_NIXL_SIDE_CHANNEL_PORT"] != d.extra_env["VLLM_NIXL_SIDE_CHANNEL_PORT"]
    assert _flag(vllm.front.argv, "--prefill") and _flag(vllm.front.argv, "--consumer")


def test_vllm_mooncake_is_upstreams_1e1pd_over_tcp_with_the_consumers_control_address_named_to_the_proxy(
        serving, tmp_path):
    system = serving.System("vllm-mooncake", "/models/m", [0, 1], str(tmp_path), "{}")
    (e, _), (pd, _) = system.engines
    producer, consumer = (json.loads(_flag(s.argv, "--ec-transfer-config")) for s in (e, pd))
    assert (producer["ec_connector"], consumer["ec_connector"]) == ("ECMooncakeConnector", "ECMooncakeConnector")
    assert (producer["ec_role"], consumer["ec_role"]) == ("ec_producer", "ec_consumer")
    assert producer["ec_connector_extra_config"] == consumer["ec_connector_extra_config"] == {"mooncake_protocol": "tcp"}
    assert producer["ec_buffer_device"] == consumer["ec_buffer_device"] == "cpu"
    assert "--enable-mm-embeds" in pd.argv and "--enable-mm-embeds" not in e.argv
    assert all("--enable-request-id-headers" in s.argv for s in (e, pd))
    assert [s.extra_env["VLLM_CPU_OMP_THREADS_BIND"] for s in (e, pd)] == ["0", "1"]
    assert e.extra_env["MC_FORCE_TCP"] == pd.extra_env["MC_FORCE_TCP"] == "1"
    proxy = system.front.argv
    assert proxy[1].endswith("mooncake_proxy.py")
    assert _flag(proxy, "--consumer-zmq") == f"tcp://{consumer['ec_ip']}:{consumer['ec_port']}"
    assert _flag(proxy, "--encoder").startswith("http://") and _flag(proxy, "--consumer") != _flag(proxy, "--encoder")
    assert ("--no-rewrite" in proxy) == (not serving.MOONCAKE_REWRITE)


def test_vllm_mooncake_puts_unpacked_verbs_libraries_first_on_the_library_path(serving, tmp_path, monkeypatch):
    assert "LD_LIBRARY_PATH" not in serving.mooncake_env(str(tmp_path / "none"))
    libdir = tmp_path / "usr" / "lib" / "x86_64-linux-gnu"
    libdir.mkdir(parents=True)
    monkeypatch.setenv("LD_LIBRARY_PATH", "/opt/x")
    assert serving.mooncake_env(str(tmp_path))["LD_LIBRARY_PATH"] == f"{libdir}{os.pathsep}/opt/x"


def test_epd_nixl_forces_the_nixl_transport_on_both_ends_and_is_otherwise_epd(serving, tmp_path):
    nixl = serving.System("epd-nixl", "/models/m", [0, 1], str(tmp_path), "{}")
    plain = serving.System("epd", "/models/m", [0, 1], str(tmp_path), "{}")
    assert [_flag(svc.argv, "--transports") for svc, _ in nixl.engines] == ["nixl", "nixl"]
    assert [svc.args[0] for svc, _ in nixl.engines] == [svc.args[0] for svc, _ in plain.engines] == ["encoder", "lm"]
    assert all("--transports" not in svc.argv for svc, _ in plain.engines)
