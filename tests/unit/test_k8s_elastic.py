"""The elastic overlay (docker/k8s/overlays/elastic) and prometheus-adapter's rules
(docker/k8s/prometheus-adapter/values.yaml) stay in step with the code: one HorizontalPodAutoscaler per
engine role, each asking only for metrics an adapter rule serves; every rule reading a series the services
(or vLLM's Prometheus logger, in the LM's process) define, found by reading their source, so renaming a
series in the code fails here; and pods that drain (preStop, then SIGTERM and ``--drain-grace-s``) within
the time kubelet gives them. The overlay's schema validation and the checks every overlay passes are in
test_k8s_manifest.py."""

from __future__ import annotations

import ast
import functools
import importlib.util
import os
import re

import pytest

from peerauth import SecurityConfig
from services.common.config import from_args
from services.gateway.config import GatewayConfig
from tests.unit.test_k8s_manifest import K8S, allowed, containers, of_kind, parse, render

yaml = pytest.importorskip("yaml")
pytestmark = pytest.mark.unit

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
ADAPTER = os.path.join(K8S, "prometheus-adapter", "values.yaml")
STOP_MARGIN_S = 10
"""What a service needs after its drain to stop its server and engine (vLLM's shutdown takes seconds)."""
_CONSTRUCTORS = {"Counter": "counter", "Gauge": "gauge", "Histogram": "histogram", "Summary": "summary",
                 "CounterMetricFamily": "counter", "GaugeMetricFamily": "gauge",
                 "HistogramMetricFamily": "histogram", "_gauge_cls": "gauge", "_counter_cls": "counter",
                 "_histogram_cls": "histogram"}


def _series_of(name: str, kind: str) -> set[str]:
    """The sample names a metric of ``kind`` named ``name`` is exposed as (prometheus_client's rules)."""
    if kind == "counter":
        return {name if name.endswith("_total") else f"{name}_total"}
    if kind in ("histogram", "summary"):
        return {f"{name}_{suffix}" for suffix in ("bucket", "sum", "count")} | {name}
    return {name}


def _defined_in(path: str) -> set[str]:
    """The series the metrics constructed in ``path`` expose: every call of a Prometheus metric class (or
    vLLM's logger's ``self._gauge_cls`` and kin) whose name is a string literal."""
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    out: set[str] = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
        if func not in _CONSTRUCTORS:
            continue
        named = [k.value for k in node.keywords if k.arg == "name"] + node.args[:1]
        if named and isinstance(named[0], ast.Constant) and isinstance(named[0].value, str):
            out |= _series_of(named[0].value, _CONSTRUCTORS[func])
    return out


@functools.cache
def exported() -> frozenset[str]:
    """Every series the services define (services/, ectransfer/) and vLLM's Prometheus logger, which the
    LM's engine runs in the LM's process (vllm/v1/metrics/loggers.py, read without importing vLLM)."""
    files = [os.path.join(d, f) for top in ("services", "ectransfer") for d, _, fs in os.walk(os.path.join(ROOT, top))
             for f in fs if f.endswith(".py")]
    vllm_dir = importlib.util.find_spec("vllm").submodule_search_locations[0]
    files.append(os.path.join(vllm_dir, "v1", "metrics", "loggers.py"))
    return frozenset().union(*(_defined_in(f) for f in files))


def adapter_rules() -> dict[str, list[dict]]:
    with open(ADAPTER) as f:
        rules = yaml.safe_load(f)["rules"]
    assert rules["default"] is False  # only these rules: the chart's defaults would expose every series
    return {"custom": rules["custom"], "external": rules["external"]}


def series_read(rule: dict) -> str:
    """The series a rule's ``seriesQuery`` selects: ``name{...}`` or ``{__name__="name",...}``."""
    query = rule["seriesQuery"]
    m = re.fullmatch(r'([a-zA-Z_:][a-zA-Z0-9_:]*)\{.*\}', query) or re.search(r'__name__="([^"]+)"', query)
    assert m, f"no series name in {query!r}"
    return m.group(1)


def served(kind: str) -> set[str]:
    """The metric names the adapter serves: ``kind`` "custom" (per pod) or "external"."""
    return {rule["name"]["as"] for rule in adapter_rules()[kind]}


def test_the_scanner_finds_the_signals_and_vllms_series_and_not_a_misspelling():
    names = exported()
    for name in ("epd_encoder_queue_depth", "epd_encoder_busy_seconds_total", "epd_encoder_items_total",
                 "epd_lm_waiting_for_items", "epd_instance_draining", "epd_gateway_objective_attainment",
                 "epd_gateway_stage_seconds_bucket", "vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:kv_cache_usage_perc"):
        assert name in names, name
    assert "epd_encoder_busy_second_total" not in names and "vllm:kv_cache_usage_percent" not in names


@pytest.mark.parametrize("kind", ["custom", "external"])
def test_every_adapter_rule_reads_a_series_the_code_exports_and_names_what_it_serves(kind):
    for rule in adapter_rules()[kind]:
        series = series_read(rule)
        assert series in exported(), f"{series}: no metric of that name in services/, ectransfer/ or vLLM's logger"
        assert re.search(rule["name"]["matches"], series), rule["name"]
        assert re.fullmatch(r"[a-z_]+", rule["name"]["as"]), rule["name"]  # a name the metrics APIs take
        assert "<<.Series>>" in rule["metricsQuery"] and "<<.LabelMatchers>>" in rule["metricsQuery"]
        overrides = rule["resources"]["overrides"]
        assert set(overrides) == ({"namespace", "pod"} if kind == "custom" else {"namespace"}), rule["name"]


def test_each_engine_role_has_one_autoscaler_on_metrics_the_adapter_serves():
    docs = render("elastic")
    deployments = of_kind(docs, "Deployment")
    hpas = of_kind(docs, "HorizontalPodAutoscaler")
    targets = sorted(h["spec"]["scaleTargetRef"]["name"] for h in hpas.values())
    assert targets == ["epd-encoder", "epd-lm"]
    for name, hpa in hpas.items():
        spec = hpa["spec"]
        assert spec["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": name}
        assert name in deployments
        # Two at least: one pod may drain (its budget allows one) while another serves.
        assert 2 <= spec["minReplicas"] < spec["maxReplicas"]
        kinds = set()
        for metric in spec["metrics"]:
            kinds.add(metric["type"])
            if metric["type"] == "Pods":
                assert metric["pods"]["metric"]["name"] in served("custom"), (name, metric)
            else:
                assert metric["type"] == "External", (name, metric)
                assert metric["external"]["metric"]["name"] in served("external"), (name, metric)
        assert kinds == {"Pods", "External"}, name


def test_the_lms_autoscaler_reads_the_gateways_objective_for_a_label_the_gateway_sets():
    from services.gateway.objectives import OBJECTIVE_NAMES

    (hpa,) = [h for h in of_kind(render("elastic"), "HorizontalPodAutoscaler").values()
              if h["spec"]["scaleTargetRef"]["name"] == "epd-lm"]
    (external,) = [m["external"] for m in hpa["spec"]["metrics"] if m["type"] == "External"]
    assert external["metric"]["name"] == "epd_gateway_objective_miss"
    assert external["metric"]["selector"]["matchLabels"]["objective"] in OBJECTIVE_NAMES


def _sleep_s(container: dict) -> float:
    argv = container["lifecycle"]["preStop"]["exec"]["command"]
    assert argv[0] == "sleep" and len(argv) == 2, argv
    return float(argv[1])


def test_engine_pods_drain_within_the_time_kubelet_gives_them():
    docs = render("elastic")
    (gateway,) = [c for _, _, c in containers(docs) if c["name"] == "gateway"]
    gw = from_args(GatewayConfig, parse(gateway["args"]))
    seen = set()
    for dep, pod, c in containers(docs):
        if c["name"] == "gateway":
            continue
        where = dep["metadata"]["name"]
        seen.add(c["name"])
        grace_s = parse(c["args"]).drain_grace_s
        sleep_s = _sleep_s(c)
        assert sleep_s > gw.dns_refresh_s, where  # every gateway has dropped the pod when SIGTERM comes
        assert pod["terminationGracePeriodSeconds"] >= sleep_s + grace_s + STOP_MARGIN_S, where
        # The drain waits as long as the gateway would for what the pod holds: an encode, or a whole request.
        assert grace_s >= (gw.encode_timeout_s if c["name"] == "encoder" else gw.request_timeout_s), where
    assert seen == {"encoder", "lm"}


def test_the_gateways_internal_port_is_on_guarded_and_closed_to_everyone_but_whom_you_let_in(tmp_path):
    for name in ("auth-token", "cert.pem", "key.pem", "ca.pem"):
        (tmp_path / name).write_text("x\n")
    docs = render("elastic")
    (dep, _, c) = [x for x in containers(docs) if x[2]["name"] == "gateway"][0]
    ns = parse(c["args"])
    assert ns.metrics_port in {p["containerPort"] for p in c["ports"]}
    for flag in ("auth_token_file", "tls_cert", "tls_key", "tls_ca"):
        setattr(ns, flag, str(tmp_path / os.path.basename(getattr(ns, flag))))
    from_args(SecurityConfig, ns).require_for(ns.metrics_host, "the gateway's metrics port")  # raises if refused
    assert allowed(docs, dep["metadata"]["name"], ns.metrics_port, "ingress") == set()
