"""The gateway with a credential of its own (docker/k8s: the Secret ``epd-gateway``), against real
grpc.aio servers on loopback: made by the same openssl steps as docker/k8s/README.md (one CA, a
certificate for the engines and one for the gateway), engines take the gateway's calls, and a
server presenting the gateway's certificate cannot pass for an engine, because peers check the
engines' name (``--tls-server-name epd-internal``)."""

from __future__ import annotations

import asyncio
import shutil
import subprocess

import grpc
import pytest

from epd.encoder.v1 import encoder_pb2, encoder_pb2_grpc
from peerauth import SecurityConfig
from services.common.grpc_server import GrpcServer
from services.common.protocol import ENCODER_PROTOCOL

pytestmark = pytest.mark.integration

ENGINES = "epd-internal"
# docker/k8s/README.md, "Before applying", without the kubectl lines.
RECIPE = r"""
set -e
mkdir -p epd-internal epd-gateway
openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 30 -subj "/CN=epd-serve CA" \
  -keyout ca.key -out ca.pem
for who in epd-internal epd-gateway; do
  openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -subj "/CN=$who" \
    -keyout $who/key.pem -out $who.csr
  printf 'subjectAltName=DNS:%s\nextendedKeyUsage=serverAuth,clientAuth\n' $who > $who.ext
  openssl x509 -req -in $who.csr -CA ca.pem -CAkey ca.key -days 30 -extfile $who.ext -out $who/cert.pem
  cp ca.pem $who/ca.pem
done
head -c 32 /dev/urandom | base64 | tee epd-internal/auth-token > epd-gateway/auth-token
"""


class Encoder(encoder_pb2_grpc.EncoderServiceServicer):
    async def GetInfo(self, request, context):
        return encoder_pb2.EncoderInfo(encoder_id="e", protocol=ENCODER_PROTOCOL)


@pytest.fixture
def credentials(tmp_path):
    """(engines' SecurityConfig, gateway's SecurityConfig), from the two Secrets' files."""
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command")
    subprocess.run(["bash", "-c", RECIPE], cwd=tmp_path, check=True, capture_output=True, timeout=60)

    def secret(name: str) -> SecurityConfig:
        d = tmp_path / name
        return SecurityConfig(tls_cert=str(d / "cert.pem"), tls_key=str(d / "key.pem"), tls_ca=str(d / "ca.pem"),
                              tls_server_name=ENGINES, auth_token_file=str(d / "auth-token"))

    return secret("epd-internal"), secret("epd-gateway")


async def _get_info(server_security: SecurityConfig, client_security: SecurityConfig) -> grpc.StatusCode:
    server = GrpcServer("127.0.0.1", 0, server_security)
    server.add(encoder_pb2_grpc.add_EncoderServiceServicer_to_server, Encoder(), "epd.encoder.v1.EncoderService")
    port = await server.start()
    try:
        async with client_security.aio_channel(f"127.0.0.1:{port}") as ch:
            await encoder_pb2_grpc.EncoderServiceStub(ch).GetInfo(encoder_pb2.GetInfoRequest(), timeout=30)
        return grpc.StatusCode.OK
    except grpc.aio.AioRpcError as e:
        return e.code()
    finally:
        await server.stop(0)


def test_engines_take_calls_from_the_gateways_own_certificate_and_from_each_other(credentials):
    engines, gateway = credentials
    assert asyncio.run(_get_info(engines, gateway)) == grpc.StatusCode.OK
    assert asyncio.run(_get_info(engines, engines)) == grpc.StatusCode.OK  # an LM dialing an encoder


def test_the_gateways_certificate_cannot_serve_as_an_engine(credentials):
    """A server holding only the gateway's credential (a compromised gateway standing up a fake
    encoder) is refused by an LM, which checks the engines' name in the server's certificate."""
    engines, gateway = credentials
    fake = SecurityConfig(tls_cert=gateway.tls_cert, tls_key=gateway.tls_key, tls_ca=engines.tls_ca,
                          auth_token_file=gateway.auth_token_file)
    assert asyncio.run(_get_info(fake, engines)) == grpc.StatusCode.UNAVAILABLE
