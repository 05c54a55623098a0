"""``epd certs DIR``: a private CA and one certificate for the services.

For tests, ``epd up --tls`` and first deployments: the certificate (valid for
the given names and addresses, both server and client use) is what every
service presents, and the CA is what every service checks its peers against
(mutual TLS). Production clusters issue their own (cert-manager, a mesh); the
services only need the three PEM paths. Keys are written 0600 and never leave
``dir``; the caller owns ``dir`` and removes it.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import secrets

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


def _write(path: str, data: bytes, mode: int) -> None:
    """Writes ``path`` with exactly ``mode`` (an existing file keeps its mode
    on open; a link at the name is refused, not followed)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, mode)
    os.fchmod(fd, mode)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def make_certs(dir: str, hosts: list[str], days: int = 30) -> dict[str, str]:
    """Writes ``ca.pem``, ``cert.pem`` and ``key.pem`` (EC P-256) into ``dir``
    and returns their paths as ``{"tls_ca", "tls_cert", "tls_key"}``."""

    os.makedirs(dir, mode=0o700, exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc)
    pem = serialization.Encoding.PEM

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "epd-serve private CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=days))
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                       content_commitment=False, key_encipherment=False, data_encipherment=False,
                                       key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
          .sign(ca_key, hashes.SHA256()))

    sans: list[x509.GeneralName] = []
    for h in hosts:
        try:
            sans.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            sans.append(x509.DNSName(h))
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hosts[0] if hosts else "epd-serve")]))
            .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(x509.SubjectAlternativeName(sans), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .sign(ca_key, hashes.SHA256()))

    paths = {"tls_ca": os.path.join(dir, "ca.pem"), "tls_cert": os.path.join(dir, "cert.pem"),
             "tls_key": os.path.join(dir, "key.pem")}
    _write(paths["tls_ca"], ca.public_bytes(pem), 0o644)
    _write(paths["tls_cert"], cert.public_bytes(pem), 0o644)
    _write(paths["tls_key"], key.private_bytes(pem, serialization.PrivateFormat.PKCS8,
                                               serialization.NoEncryption()), 0o600)
    return paths


def make_token(path: str) -> str:
    """A random shared token, written 0600 to ``path``; returns the path."""
    _write(path, secrets.token_urlsafe(32).encode() + b"\n", 0o600)
    return path
