"""The Kubernetes manifests (docker/k8s: a kustomize base and overlays) render,
pass the Kubernetes API schemas strictly and offline (kubernetes-validate's
bundled schemas: an unknown field fails), and stay in step with the CLI and with
each other: every container's args and probe commands parse with ``epd``'s
parser, every internal link carries TLS and the token, the gateway holds a
credential of its own, LMs dial only encoders on the pod network, the gateway
finds the headless Services, Services, NetworkPolicies and PodDisruptionBudgets
select the pods they mean, and DNS goes only to the cluster's resolver. The elastic overlay's autoscalers
ask prometheus-adapter only for metrics its rules serve, and those rules read only series the services
export; its pods drain before kubelet kills them (``tests/unit/test_k8s_elastic.py``)."""

from __future__ import annotations

import copy
import functools
import os
import shutil
import socket
import subprocess

import pytest

from peerauth import SecurityConfig
from services.cli import build_parser
from services.common.config import from_args
from services.gateway.config import GatewayConfig
from services.lm.config import LMServiceConfig
from services.lm.peers import EncoderAllowList

yaml = pytest.importorskip("yaml")
kv = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate is in the test extra: pip install -e .[test]")
pytestmark = pytest.mark.unit

K8S = os.path.join(os.path.dirname(__file__), "..", "..", "docker", "k8s")
OVERLAYS = ("cpu", "gpu-node", "multi-node", "pd-tiers", "elastic")
# The oldest Kubernetes release the manifests are checked against (every field they use is GA or
# on by default there), and the newest whose schemas kubernetes-validate bundles.
K8S_VERSIONS = ("1.29", kv.latest_version())
SECRET_DIR = "/etc/epd"
ENGINE_SECRET, GATEWAY_SECRET, STATE_SECRET = "epd-internal", "epd-gateway", "epd-state"
ANY = "any"  # a NetworkPolicy rule with no peers: every source or destination
CLUSTER_DNS = "kube-system/kube-dns"  # the one peer outside the namespace the policies may name
CLUSTER_DNS_PEER = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "kube-system"}},
                    "podSelector": {"matchLabels": {"k8s-app": "kube-dns"}}}


@functools.cache
def _rendered(overlay: str) -> tuple[dict, ...]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed: it renders the kustomize overlays (kubectl kustomize)")
    out = subprocess.run([kubectl, "kustomize", os.path.join(K8S, "overlays", overlay)],
                         check=False, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return tuple(d for d in yaml.safe_load_all(out.stdout) if d)


def render(overlay: str) -> list[dict]:
    """The overlay's objects; a deep copy, so a test may change them."""
    return copy.deepcopy(list(_rendered(overlay)))


def base_objects() -> list[dict]:
    """The base's objects read as written (no kubectl needed)."""
    base = os.path.join(K8S, "base")
    docs: list[dict] = []
    for name in sorted(os.listdir(base)):
        if name != "kustomization.yaml":
            with open(os.path.join(base, name)) as f:
                docs += [d for d in yaml.safe_load_all(f) if d]
    return docs


def of_kind(docs: list[dict], kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def containers(docs: list[dict], every: bool = False):
    """(deployment, pod spec, container) for every container of every Deployment that runs ``epd`` (the
    epd-serve image); ``every``: the others too (the multi-node overlay's state store)."""
    for dep in of_kind(docs, "Deployment").values():
        pod = dep["spec"]["template"]["spec"]
        for c in pod["containers"]:
            if every or c["image"].split(":")[0].endswith("epd-serve"):
                yield dep, pod, c


def parse(argv: list[str]):
    return build_parser().parse_args([a.replace("$(POD_IP)", "10.0.0.7") for a in argv])


def selects(selector: dict, labels: dict) -> bool:
    assert set(selector) <= {"matchLabels"}, f"only matchLabels is understood here: {selector}"
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())


def pods_selected(docs: list[dict], selector: dict) -> set[str]:
    """Names of the Deployments whose pods ``selector`` (a label selector) matches."""
    return {name for name, dep in of_kind(docs, "Deployment").items()
            if selects(selector, dep["spec"]["template"]["metadata"]["labels"])}


def allowed(docs: list[dict], deployment: str, port: int, direction: str) -> set[str] | str:
    """The Deployments whose pods the NetworkPolicies let reach ``deployment``'s pods on ``port``
    (direction "ingress"), or that those pods may reach on ``port`` ("egress"), and CLUSTER_DNS for
    the cluster's DNS pods; ANY when a rule names no peers or an ipBlock. Pods no policy selects for
    the direction are open (ANY)."""
    labels = of_kind(docs, "Deployment")[deployment]["spec"]["template"]["metadata"]["labels"]
    policies = [p for p in of_kind(docs, "NetworkPolicy").values()
                if selects(p["spec"]["podSelector"], labels) and direction.capitalize() in p["spec"]["policyTypes"]]
    if not policies:
        return ANY
    peers_key = "from" if direction == "ingress" else "to"
    out: set[str] = set()
    for policy in policies:
        for rule in policy["spec"].get(direction, []):
            if "ports" in rule and not any(p["port"] <= port <= p.get("endPort", p["port"]) for p in rule["ports"]):
                continue
            if peers_key not in rule:
                return ANY
            for peer in rule[peers_key]:
                if "namespaceSelector" in peer:
                    assert peer == CLUSTER_DNS_PEER, f"a peer outside the namespace: {peer}"
                    out.add(CLUSTER_DNS)
                    continue
                if "ipBlock" in peer:
                    return ANY
                out |= pods_selected(docs, peer["podSelector"])
    return out


def serving(docs: list[dict], cmd: str) -> set[str]:
    """Deployments with a container that runs ``epd <cmd>``."""
    return {dep["metadata"]["name"] for dep, _, c in containers(docs) if c["args"][0] == cmd}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_overlay_renders_and_passes_the_strict_api_schemas_offline(overlay, monkeypatch):
    docs = render(overlay)
    autoscaled = {"HorizontalPodAutoscaler"} if overlay == "elastic" else set()
    assert {d["kind"] for d in docs} == {"Deployment", "Service", "NetworkPolicy", "PodDisruptionBudget", *autoscaled}

    def no_network(*args, **kwargs):
        raise AssertionError("schema validation tried to reach the network")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    monkeypatch.setattr(socket, "create_connection", no_network)
    errors = []
    for version in K8S_VERSIONS:
        for d in docs:
            try:
                kv.validate(d, version, strict=True)
            except kv.ValidationError as e:
                where = ".".join(str(p) for p in e.path)
                errors.append(f"{d['kind']}/{d['metadata']['name']} at {where} (Kubernetes {version}): {e.message}")
    assert not errors, "\n".join(errors)


@pytest.mark.parametrize("kind,name,path,field,typo", [
    ("Deployment", "epd-encoder", ["spec"], "replicas", "replcas"),
    ("Deployment", "epd-lm", ["spec", "template", "spec", "containers", 0], "readinessProbe", "readinessProbes"),
    ("Deployment", "epd-gateway", ["spec", "template", "spec", "securityContext"], "runAsNonRoot", "runAsNonRooot"),
    ("NetworkPolicy", "epd-encoder", ["spec", "ingress", 0], "from", "form"),
    ("PodDisruptionBudget", "epd-lm", ["spec"], "maxUnavailable", "maxUnavailble"),
])
def test_strict_validation_fails_on_a_misspelled_field(kind, name, path, field, typo):
    obj = of_kind(base_objects(), kind)[name]
    kv.validate(obj, K8S_VERSIONS[-1], strict=True)  # the object as rendered passes
    node = obj
    for key in path:
        node = node[key]
    node[typo] = node.pop(field)
    with pytest.raises(kv.ValidationError, match=f"'{typo}' was unexpected"):
        kv.validate(obj, K8S_VERSIONS[-1], strict=True)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_container_args_parse_with_the_epd_cli(overlay):
    names = set()
    for dep, _, c in containers(render(overlay)):
        ns = parse(c["args"])
        assert ns.cmd == c["name"], (dep["metadata"]["name"], c["name"])
        names.add(c["name"])
    assert names == {"encoder", "lm", "gateway"}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_internal_link_is_authenticated_and_probes_speak_tls(overlay):
    for dep, pod, c in containers(render(overlay)):
        where = (dep["metadata"]["name"], c["name"])
        ns = parse(c["args"])
        for path in (ns.auth_token_file, ns.tls_cert, ns.tls_key, ns.tls_ca):
            assert path.startswith(SECRET_DIR + "/"), where
        assert ns.tls_server_name == "epd-internal" and not ns.insecure, where
        mount = next(m for m in c["volumeMounts"] if m["mountPath"] == SECRET_DIR)
        assert mount["readOnly"] is True, where
        volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
        assert volume["secret"]["secretName"] == (GATEWAY_SECRET if ns.cmd == "gateway" else ENGINE_SECRET), where
        if ns.cmd == "gateway":  # its own ports are public: kubelet's plaintext probes work there
            assert c["readinessProbe"]["httpGet"] == {"path": "/health", "port": ns.port}, where
            for probe in ("livenessProbe", "startupProbe"):
                assert c[probe]["grpc"]["port"] == ns.grpc_port, (where, probe)
            continue
        for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
            argv = c[probe]["exec"]["command"]
            assert argv[0] == "epd", (where, probe)
            probe_ns = build_parser().parse_args(argv[1:])
            assert probe_ns.cmd == "health" and probe_ns.address == f"127.0.0.1:{ns.port}", (where, probe)
            for flag in ("tls_cert", "tls_key", "tls_ca", "tls_server_name"):
                assert getattr(probe_ns, flag) == getattr(ns, flag), (where, probe, flag)
        service = {"encoder": "epd.encoder.v1.EncoderService", "lm": "epd.lm.v1.LMService"}[ns.cmd]
        assert build_parser().parse_args(c["readinessProbe"]["exec"]["command"][1:]).service == service, where


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_gateway_points_at_the_headless_services_of_its_peers(overlay):
    docs = render(overlay)
    services = of_kind(docs, "Service")
    (gw,) = [c for _, _, c in containers(docs) if c["name"] == "gateway"]
    cfg = from_args(GatewayConfig, parse(gw["args"]))
    assert cfg.encoder_list == ["epd-encoder:50051"] and cfg.lm_list == ["epd-lm:50061"]
    for address, cmd in ((cfg.encoder_list[0], "encoder"), (cfg.lm_list[0], "lm")):
        name, port = address.split(":")
        svc = services[name]
        assert svc["spec"]["clusterIP"] == "None", name  # one address per pod: the gateway routes itself
        assert int(port) in {p["port"] for p in svc["spec"]["ports"]}, name
        assert pods_selected(docs, {"matchLabels": svc["spec"]["selector"]}) == serving(docs, cmd), name
    for _, _, c in containers(docs):
        if c["name"] == "encoder":  # LMs dial the address the encoder advertises: its pod IP
            assert parse(c["args"]).advertise_host == "10.0.0.7"
            assert {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}} in c["env"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_services_and_budgets_select_the_pods_they_mean(overlay):
    docs = render(overlay)
    deployments = of_kind(docs, "Deployment")
    for name, dep in deployments.items():
        assert selects(dep["spec"]["selector"], dep["spec"]["template"]["metadata"]["labels"]), name
    for name, svc in of_kind(docs, "Service").items():
        chosen = pods_selected(docs, {"matchLabels": svc["spec"]["selector"]})
        assert chosen, name
        for dep in chosen:
            ports = {p["containerPort"] for c in deployments[dep]["spec"]["template"]["spec"]["containers"]
                     for p in c["ports"]}
            assert {p["targetPort"] for p in svc["spec"]["ports"]} <= ports, (name, dep)
    # The eviction API refuses a pod that two budgets select: exactly one per Deployment.
    budgets = [pods_selected(docs, pdb["spec"]["selector"]) for pdb in of_kind(docs, "PodDisruptionBudget").values()]
    assert sorted(d for b in budgets for d in b) == sorted(deployments)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_network_policies_let_only_the_gateway_reach_apis_and_only_lms_reach_transfer(overlay):
    docs = render(overlay)
    for name, policy in of_kind(docs, "NetworkPolicy").items():
        assert pods_selected(docs, policy["spec"]["podSelector"]), f"NetworkPolicy {name} selects no pod"
        for rule in policy["spec"].get("ingress", []) + policy["spec"].get("egress", []):
            for peer in rule.get("from", []) + rule.get("to", []):
                if "podSelector" in peer and "namespaceSelector" not in peer:
                    assert pods_selected(docs, peer["podSelector"]), f"NetworkPolicy {name}: {peer} selects no pod"
    gateways, encoders, lms = serving(docs, "gateway"), serving(docs, "encoder"), serving(docs, "lm")
    for enc in encoders:
        assert allowed(docs, enc, 50051, "ingress") == gateways
        assert allowed(docs, enc, 50052, "ingress") == lms
        assert allowed(docs, enc, 9101, "ingress") == set()
    for lm in lms:
        assert allowed(docs, lm, 50061, "ingress") == gateways
        assert allowed(docs, lm, 9102, "ingress") == set()
        assert allowed(docs, lm, 50052, "egress") == encoders
    for gw in gateways:
        assert allowed(docs, gw, 8000, "ingress") == ANY and allowed(docs, gw, 50071, "ingress") == ANY
        assert allowed(docs, gw, 50051, "egress") == encoders and allowed(docs, gw, 50061, "egress") == lms
    for dep in of_kind(docs, "Deployment"):
        if dep not in gateways:  # only the gateway fetches image URLs
            assert allowed(docs, dep, 443, "egress") == set(), dep


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_dns_goes_only_to_the_clusters_resolver_over_udp_and_tcp(overlay):
    docs = render(overlay)
    for dep in of_kind(docs, "Deployment"):
        assert allowed(docs, dep, 53, "egress") == {CLUSTER_DNS}, dep  # not any address on port 53
    for name, policy in of_kind(docs, "NetworkPolicy").items():
        rules = [r for r in policy["spec"]["egress"] if CLUSTER_DNS_PEER in r.get("to", [])]
        assert len(rules) == 1, name
        assert rules[0]["to"] == [CLUSTER_DNS_PEER], name
        assert sorted((p["protocol"], p["port"]) for p in rules[0]["ports"]) == [("TCP", 53), ("UDP", 53)], name


def secrets_mounted(pod: dict) -> set[str]:
    return {v["secret"]["secretName"] for v in pod["volumes"] if "secret" in v}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_gateway_holds_a_credential_of_its_own_and_no_engine_credential(overlay):
    """The gateway's pod mounts only its own Secret and the engines' pods only theirs: a stolen
    gateway certificate is told apart from the engines' and cannot serve as epd-internal."""
    docs = render(overlay)
    for dep, pod, c in containers(docs):
        where = (dep["metadata"]["name"], c["name"])
        ns = parse(c["args"])
        if ns.cmd == "gateway":  # and, where gateways share a state store, its password and state secret
            assert secrets_mounted(pod) - {STATE_SECRET} == {GATEWAY_SECRET}, where
            assert ns.tls_cert and ns.tls_ca, where  # presents its own certificate (mutual TLS)
            assert ns.tls_server_name == "epd-internal", where  # and checks the engines' name
        else:
            assert secrets_mounted(pod) == {ENGINE_SECRET}, where


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_engine_binding_a_pod_address_meets_the_tls_and_authentication_rule(overlay, tmp_path):
    """SecurityConfig.require_for, the check each service runs before it binds, passes for every
    address an encoder or LM serves, its metrics port's included (the Secret's files stood in by local ones)."""
    for name in ("auth-token", "cert.pem", "key.pem", "ca.pem"):
        (tmp_path / name).write_text("x\n")
    for dep, _, c in containers(render(overlay)):
        ns = parse(c["args"])
        if ns.cmd == "gateway":  # its own ports are the public API; it only dials with these settings
            continue
        for flag in ("auth_token_file", "tls_cert", "tls_key", "tls_ca"):
            setattr(ns, flag, str(tmp_path / os.path.basename(getattr(ns, flag))))
        security = from_args(SecurityConfig, ns)
        metrics = [ns.metrics_host] if ns.metrics_port else []
        for host in [ns.host, *metrics] + ([ns.transfer_host] if ns.cmd == "encoder" else []):
            security.require_for(host, f"{dep['metadata']['name']}/{c['name']} on {host}")  # raises if refused


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_lms_dial_only_encoders_on_the_pod_network(overlay):
    docs = render(overlay)
    transfer = {f"{ns.advertise_host}:{ns.transfer_port}" for ns in (parse(c["args"]) for _, _, c in containers(docs))
                if ns.cmd == "encoder"}
    assert transfer
    lms = [parse(c["args"]) for _, _, c in containers(docs) if c["name"] == "lm"]
    assert lms
    for ns in lms:
        # Empty would allow any endpoint here (the callers authenticate): it must be set.
        assert ns.allowed_encoders, "the LM needs --allowed-encoders"
        allow = EncoderAllowList.parse(ns.allowed_encoders, trusted_callers=True)
        assert not allow.any
        for endpoint in transfer:  # what the encoders advertise ($(POD_IP) stands in as 10.0.0.7)
            assert allow.allows(endpoint), endpoint
        for pod_ip in ("10.244.1.5", "10.42.0.5", "192.168.3.4", "172.17.0.3", "[fd00:10:244::5]"):
            assert allow.allows(f"{pod_ip}:50052"), pod_ip  # the common clusters' pod networks
        for outside in ("127.0.0.1", "[::1]", "169.254.169.254", "[fe80::1]", "8.8.8.8", "[2001:4860::8888]",
                        "metadata.google.internal", "epd-gateway"):
            assert not allow.allows(f"{outside}:50052"), outside


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_container_runs_non_root_read_only_and_bounded(overlay):
    for dep, pod, c in containers(render(overlay), every=True):
        where = (dep["metadata"]["name"], c["name"])
        assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] > 0, where
        # The Secret's files are root's, 0440: the pod's fsGroup is what lets the user read them.
        assert pod["securityContext"]["fsGroup"] == pod["securityContext"]["runAsGroup"], where
        sc = c["securityContext"]
        assert sc["allowPrivilegeEscalation"] is False and sc["capabilities"] == {"drop": ["ALL"]}, where
        assert sc["readOnlyRootFilesystem"] is True, where
        mounted = {m["mountPath"] for m in c["volumeMounts"]}
        assert "/tmp" in mounted, where
        if c["name"] not in ("gateway", "state"):  # vLLM's caches under $HOME, its pools in /dev/shm
            assert {"/home/epd", "/dev/shm"} <= mounted, where
        requests, limits = c["resources"]["requests"], c["resources"]["limits"]
        assert {"cpu", "memory"} <= set(requests) and set(requests) == set(limits), where
        for key in ("hostIPC", "hostPID", "hostNetwork"):
            assert not pod.get(key), (where, key)
        assert not pod.get("shareProcessNamespace") or {"encoder", "lm"} <= {x["name"] for x in pod["containers"]}


def test_gpu_node_puts_encoder_and_lm_in_one_pod_for_cuda_ipc():
    docs = render("gpu-node")
    (pod,) = [d["spec"]["template"]["spec"] for d in of_kind(docs, "Deployment").values()
              if {c["name"] for c in d["spec"]["template"]["spec"]["containers"]} == {"encoder", "lm"}]
    assert pod["shareProcessNamespace"] is True  # distinct PIDs: CUDA IPC refuses a handle from "itself"
    shm = {c["name"]: next(m["name"] for m in c["volumeMounts"] if m["mountPath"] == "/dev/shm")
           for c in pod["containers"]}
    assert shm["encoder"] == shm["lm"]
    assert next(v for v in pod["volumes"] if v["name"] == shm["lm"])["emptyDir"]["medium"] == "Memory"
    args = {c["name"]: parse(c["args"]) for c in pod["containers"]}
    assert args["encoder"].transports.split(",")[0] == "cuda_ipc"
    assert args["lm"].transports == "cuda_ipc,shm,grpc"
    for c in pod["containers"]:
        assert c["resources"]["requests"]["nvidia.com/gpu"] == c["resources"]["limits"]["nvidia.com/gpu"] == "1"


def test_multi_node_spreads_encoders_and_lms_over_nodes_and_uses_grpc_between_pods():
    docs = render("multi-node")
    deployments = of_kind(docs, "Deployment")
    for name in ("epd-encoder", "epd-lm"):
        dep = deployments[name]
        assert dep["spec"]["replicas"] > 1, name
        (spread,) = [t for t in dep["spec"]["template"]["spec"]["topologySpreadConstraints"]
                     if t["topologyKey"] == "kubernetes.io/hostname"]
        assert spread["whenUnsatisfiable"] == "DoNotSchedule"
        assert pods_selected(docs, spread["labelSelector"]) == {name}
    (lm,) = deployments["epd-lm"]["spec"]["template"]["spec"]["containers"]
    assert parse(lm["args"]).transports == "grpc"


def test_multi_node_gateways_run_workers_over_one_state_store_that_only_gateways_reach():
    """Both gateway replicas run two workers, decide places and quotas on the one state store (its password
    and the state secret from the Secret ``epd-state``, never on a command line) and count themselves for
    the store's fallback share; only gateway pods reach the store, and the store dials nothing."""
    docs = render("multi-node")
    deployments = of_kind(docs, "Deployment")
    gateway = deployments["epd-gateway"]
    (c,) = gateway["spec"]["template"]["spec"]["containers"]
    ns = parse(c["args"])
    cfg = from_args(GatewayConfig, ns)
    assert cfg.workers == 2 and cfg.state_store == "redis://epd-state:6379/0"
    assert cfg.state_store_replicas == gateway["spec"]["replicas"] == 2
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    for path in (cfg.state_store_password_file, cfg.state_secret_file):
        assert mounts[os.path.dirname(path)] == "epd-state", path
    volume = next(v for v in gateway["spec"]["template"]["spec"]["volumes"] if v["name"] == "epd-state")
    assert volume["secret"]["secretName"] == "epd-state"
    assert {i["key"] for i in volume["secret"]["items"]} == {"password", "state-secret"}  # not redis.conf
    assert deployments["epd-state"]["spec"]["replicas"] == 1
    assert allowed(docs, "epd-state", 6379, "ingress") == {"epd-gateway"}
    assert allowed(docs, "epd-state", 6379, "egress") == set() and allowed(docs, "epd-state", 443, "egress") == set()
    assert "epd-state" in allowed(docs, "epd-gateway", 6379, "egress")
    service = of_kind(docs, "Service")["epd-state"]
    assert pods_selected(docs, {"matchLabels": service["spec"]["selector"]}) == {"epd-state"}


def test_pd_tiers_open_nixls_side_channel_only_where_another_node_dials_it_and_only_to_the_tiers():
    """The prefill pods' side channel is on the pod address (decode pods on other nodes dial it), with the
    opt-in the LM demands for it; the decode pods' stays on loopback (nobody dials it); the LMs' own bind
    rule (``LMServiceConfig``) accepts both; only prefill and decode pods reach the port."""
    docs = render("pd-tiers")
    lms = {dep["metadata"]["name"]: parse(c["args"]) for dep, _, c in containers(docs) if c["name"] == "lm"}
    assert set(lms) == {"epd-prefill", "epd-decode"}
    prefill, decode = lms["epd-prefill"], lms["epd-decode"]
    assert prefill.role == "prefill" and prefill.kv_host == "10.0.0.7" and prefill.insecure_kv_side_channel
    assert decode.role == "decode" and decode.kv_host == "127.0.0.1" and not decode.insecure_kv_side_channel
    for ns in lms.values():
        from_args(LMServiceConfig, ns)  # raises where the LM would refuse to start
    prefill.insecure_kv_side_channel = False
    with pytest.raises(ValueError, match="--insecure-kv-side-channel"):
        from_args(LMServiceConfig, prefill)
    assert allowed(docs, "epd-prefill", prefill.kv_port, "ingress") == {"epd-prefill", "epd-decode"}
    assert allowed(docs, "epd-decode", prefill.kv_port, "egress") == {"epd-prefill", "epd-decode"}
