"""E -> P -> D on three hosts: an encoder, a prefill LM and a decode LM each on its own host (network
namespace, address and /dev/shm), a gateway on a fourth. The embedding crosses the network as gRPC
chunks (twice: to P, and to D under its own claim where D needs it), the prompt's KV as vLLM's
NixlConnector moves it between the LM hosts: its side channel on the prefill host's address, UCX over
TCP (``UCX_TLS=tcp``: the hosts share one kernel, and UCX would otherwise find a shared-memory path
that separate machines do not have). Plain vLLM's tokens.

Slow (``make test-all``), as tests/e2e/test_pd.py: NIXL's progress threads busy-poll a 2-core host.
Its own hosts and services; run last in the package (after the shared deployment's scenarios).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time

import pytest

from peerauth import SecurityConfig
from services.certs import make_certs, make_token
from services.up import Service, split_cores, wait_ready
from tests.multihost.cluster import ROOT, Client, logged_ready
from tests.multihost.conftest import REQUESTS

pytestmark = [pytest.mark.multihost, pytest.mark.slow]

ENC_PORT, TRANSFER_PORT, LM_PORT, KV_PORT, GW_PORT, METRICS = 50051, 50052, 50061, 5600, 8000, 9102


class PDHosts:
    def __init__(self, net, model: str) -> None:
        self.log_dir = tempfile.mkdtemp(prefix="epd-multihost-pd-")
        self.e, self.p, self.d = net.add_host("pde"), net.add_host("pdp"), net.add_host("pdd")
        self.gw, client = net.add_host("pdgw"), net.add_host("pdclient")
        sec = make_certs(os.path.join(self.log_dir, "tls"), ["localhost", "127.0.0.1",
                                                              *(h.ip for h in (self.e, self.p, self.d, self.gw))])
        sec["auth_token_file"] = make_token(os.path.join(self.log_dir, "auth-token"))
        self.client = Client(client, SecurityConfig(**sec))
        sec_args = [a for k, v in sec.items() for a in ("--" + k.replace("_", "-"), v)]
        enc_cores, lm_cores = split_cores()
        common = ["--model", model, *sec_args]
        self.services = {
            "encoder": self._service(self.e, ["encoder", "--host", self.e.ip, "--port", str(ENC_PORT),
                                              "--transfer-host", self.e.ip, "--advertise-host", self.e.ip,
                                              "--transfer-port", str(TRANSFER_PORT), "--metrics-port", "9101",
                                              "--cpu-cores", enc_cores, *common]),
            # On 2 cores the decode LM keeps the LM core and the prefill LM shares the encoder's
            # (services.up.pd_cores), as `epd up --prefills 1 --decodes 1` places them. The decode LM
            # (on another host) dials the prefill LM's side channel: that one is on the prefill host's
            # address, with the opt-in; nobody dials the decode LM's (vLLM's NixlConnector pulls), which
            # stays on loopback.
            **{role: self._service(h, ["lm", "--role", role, "--host", h.ip, "--port", str(LM_PORT),
                                       "--kv-port", str(KV_PORT), "--metrics-port", str(METRICS),
                                       "--metrics-host", h.ip, "--cpu-cores", cores, *kv_args, *common])
               for role, h, cores, kv_args in (
                   ("prefill", self.p, enc_cores, ["--kv-host", self.p.ip, "--insecure-kv-side-channel"]),
                   ("decode", self.d, lm_cores, []))},
        }
        self.gateway = self._service(self.gw, ["gateway", "--epd-facts", "--host", self.gw.ip, "--port",
                                               str(GW_PORT), "--encoders", f"{self.e.ip}:{ENC_PORT}",
                                               "--lms", f"{self.p.ip}:{LM_PORT},{self.d.ip}:{LM_PORT}",
                                               "--health-interval-s", "2", *sec_args])

    def _service(self, host, args: list[str]) -> Service:
        name = f"{args[0]}-{host.name}"
        return Service(name, args, os.path.join(self.log_dir, f"{name}.log"),
                       command=host.wrap([sys.executable, "-m", "services.cli", *args]))

    def start(self, timeout: float = 400) -> PDHosts:
        env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=ROOT, UCX_TLS="tcp")
        deadline = time.monotonic() + timeout
        for svc in self.services.values():
            svc.start(env)
        addr = {"encoder": f"{self.e.ip}:{ENC_PORT}", "prefill": f"{self.p.ip}:{LM_PORT}",
                "decode": f"{self.d.ip}:{LM_PORT}"}
        wait_ready({svc: (lambda a=addr[n], s=svc: logged_ready(s) and self.client.health(a))
                    for n, svc in self.services.items()}, deadline, poll_s=1.0)
        self.gateway.start(env)
        want = {"encoders": {addr["encoder"]: True}, "lms": {addr["prefill"]: True, addr["decode"]: True}}
        wait_ready({self.gateway: lambda: self._health_is(want)}, deadline, poll_s=0.5)
        return self

    def _health_is(self, want: dict) -> bool:
        status, text = self.client.get(self.url + "/health")
        body = json.loads(text) if text.startswith("{") else {}
        return {k: body.get(k) for k in want} == want

    @property
    def url(self) -> str:
        return f"http://{self.gw.ip}:{GW_PORT}"

    def stop(self) -> None:
        for svc in [self.gateway, *self.services.values()]:
            svc.stop(grace=10)


@pytest.fixture(scope="module")
def pd_hosts(network, tiny_model):
    hosts = PDHosts(network, tiny_model)
    try:
        yield hosts.start()
    finally:
        hosts.stop()


def test_e_p_and_d_on_three_hosts_give_plain_vllms_tokens(pd_hosts, mh_reference):
    c = pd_hosts
    status, body, _ = c.client.post(c.url + "/v1/chat/completions", REQUESTS["pd"])
    assert status == 200, body
    assert body["choices"][0]["token_ids"] == mh_reference["pd"]
    epd = body["epd"]
    assert epd["prefill_lm"] == f"{c.p.ip}:{LM_PORT}" and epd["lm"] == f"{c.d.ip}:{LM_PORT}", epd
    assert epd["encoders"] == [f"{c.e.ip}:{ENC_PORT}"] and epd["local_encoder_runs"] == 0, epd
    d_metrics = f"https://{c.d.ip}:{METRICS}/metrics"  # beyond loopback: TLS, a client certificate, the token
    # The decode LM loaded the prompt's KV from the prefill host and computed none of it.
    assert c.client.metric(d_metrics, "vllm:prompt_tokens_by_source_total", source="local_compute") == 0
    assert c.client.metric(d_metrics, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer") > 0
