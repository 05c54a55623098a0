"""The gateway's Responses API state: which LM holds a stored response (its home) and which tenant it
belongs to (its owner), for the requests that name one (``GET`` and cancel ``/v1/responses/{id}``, a
``previous_response_id``).

Where the truth lives: in the response id. vLLM stores a Responses answer under the body's
``request_id``, which the gateway sets (``services.gateway.lm_body``) to an id minted here for the
LM that will answer and the tenant that asked: ``resp_`` and 80 lowercase hex digits, a nonce (128
random bits: unique without any coordination between replicas), the home's tag (64 bits,
HMAC-SHA256 of the LM's address under the deployment's state secret) and a MAC (128 bits,
HMAC-SHA256 of the nonce, the tag and the owner tenant's name). No gateway keeps a table: any replica
with the same secret, or this one after a restart, reads an id's home and owner from the id alone,
and no client can forge or alter either. The home and the owner are blinded (keyed), so an id tells
a client neither an LM's address nor a tenant's name; the owner is checked, never read: an id
verifies only for the tenant that made it.

The home is the LM's address (``ip:port``, the gateway pool's ``Instance.address``: a configured
address, or what a configured host name resolves to), not an index, so it means the same LM to every
replica and across restarts.

How fresh a reader's view is: exact, always; there is nothing to go stale. The stored response itself
lives in its LM's vLLM store, in memory, bounded per tenant (``services.lm.response_store``): when
that LM forgets it or restarts, the id outlives what it names, and the LM answers vLLM's 404.

When the place is unreachable: an id whose home is an LM of the pool that is not available now is
pinned to it all the same, and the orchestrator answers 503 (never another LM: none holds the
response). An id whose home is no LM of the pool (gone, or a host name not resolved yet), an id that
does not verify for the caller (another tenant's, forged, altered, minted under another secret) and
anything else in an id's place: 404, the message vLLM gives an id it has not stored, before any LM
sees the request.

The secret: ``--state-secret-file`` (one secret a line, blank lines and ``#`` comments skipped; the
first mints, every one verifies, so a secret can be rotated: add the new one first, later drop the
old), else the ``EPD_STATE_SECRET`` environment variable; each at least 32 bytes. Every replica of a
deployment needs the same. Without one, each process draws a random secret: its ids verify only in
the process that minted them (another replica, or this one after a restart, answers 404).

Owner: ``RequestCore`` makes one ``ResponseIds`` (``from_config``) and gives it to each request's
``LMBody``, which mints once per LM attempt; ``RequestCore.admit`` locates a named id (``home``). A
``ResponseIds`` never changes after it is made: any task may use it.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from epd.lm.v1 import lm_pb2

logger = logging.getLogger(__name__)

RESPONSE_ID_RE = re.compile(r"resp_(?P<nonce>[0-9a-f]{32})(?P<home>[0-9a-f]{16})(?P<mac>[0-9a-f]{32})")
"""The ids the gateway mints (85 characters): nonce, home tag, MAC."""
SECRET_ENV = "EPD_STATE_SECRET"
MIN_SECRET_BYTES = 32
_HOME = b"epd.response.home.v1\x00"
_MAC = b"epd.response.mac.v1\x00"


def read_secrets(path: str) -> list[bytes]:
    """The secrets in ``path``, one a line (blank lines and ``#`` comments skipped), in order.
    Raises ValueError (the file cannot be read, holds none, or one is short), never naming a secret."""
    try:
        with open(path, "rb") as f:
            lines = f.read().splitlines()
    except OSError as e:
        raise ValueError(f"--state-secret-file: {e.strerror or e}: {path}") from None
    found = [line.strip() for line in lines if line.strip() and not line.strip().startswith(b"#")]
    if not found:
        raise ValueError(f"--state-secret-file: {path} holds no secret")
    for n, secret in enumerate(found, 1):
        _check(secret, f"--state-secret-file: secret {n} of {path}")
    return found


def _check(secret: bytes, where: str) -> None:
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(f"{where} is {len(secret)} bytes; at least {MIN_SECRET_BYTES} are needed "
                         "(e.g. `openssl rand -hex 32`)")


class ResponseIds:
    """Mints and verifies response ids (the module docstring's format) under ``secrets`` (the first
    mints; every one verifies)."""

    def __init__(self, secrets: Sequence[bytes]) -> None:
        if not secrets:
            raise ValueError("at least one state secret is needed")
        self._secrets = tuple(secrets)

    @classmethod
    def from_config(cls, cfg: Any, environ: Mapping[str, str] = os.environ) -> ResponseIds:
        """``cfg.state_secret_file``'s secrets, else ``EPD_STATE_SECRET``'s, else a random one for this
        process (logged: its ids reach no other replica). Raises ValueError for a secret that will not do."""
        if cfg.state_secret_file:
            return cls(read_secrets(cfg.state_secret_file))
        if environ.get(SECRET_ENV):
            secret = environ[SECRET_ENV].encode()
            _check(secret, SECRET_ENV)
            return cls([secret])
        logger.warning("no --state-secret-file or %s: response ids are signed with this process's own secret, "
                       "so a stored response is reachable only through this gateway process (not another "
                       "replica, nor this one after a restart)", SECRET_ENV)
        return cls([os.urandom(32)])

    def mint(self, home: str, owner: str) -> str:
        """A fresh id for a response that the LM at ``home`` will store for the tenant ``owner``."""
        nonce = os.urandom(16)
        tag = _tag(self._secrets[0], home)
        return "resp_" + (nonce + tag + _mac(self._secrets[0], nonce, tag, owner)).hex()

    def home(self, response_id: object, owner: str, addresses: Iterable[str]) -> str | None:
        """The address in ``addresses`` that holds ``response_id``, when the id is one this deployment
        minted for ``owner``; None otherwise (not an id of ours, another tenant's, or its LM is gone)."""
        m = RESPONSE_ID_RE.fullmatch(response_id) if isinstance(response_id, str) else None
        if m is None:
            return None
        nonce, tag, mac = (bytes.fromhex(m[k]) for k in ("nonce", "home", "mac"))
        for secret in self._secrets:
            if hmac.compare_digest(_mac(secret, nonce, tag, owner), mac):
                return next((a for a in addresses if hmac.compare_digest(_tag(secret, a), tag)), None)
        return None


def _tag(secret: bytes, address: str) -> bytes:
    return hmac.new(secret, _HOME + address.encode(), hashlib.sha256).digest()[:8]


def _mac(secret: bytes, nonce: bytes, tag: bytes, owner: str) -> bytes:
    return hmac.new(secret, _MAC + nonce + tag + owner.encode(), hashlib.sha256).digest()[:16]


def named_response(api: str, body: dict, path: str) -> str | None:
    """The stored response a request names (``api``: a name in ``request.APIS``): a Responses POST's
    ``previous_response_id`` (when a string: any other value is vLLM's to refuse), or the id in a
    ``GET``/cancel path; None when it names none."""
    if api == "responses":
        named = body.get("previous_response_id")
        return named if isinstance(named, str) else None
    if api.startswith("responses_"):
        return path.rstrip("/").removesuffix("/cancel").rsplit("/", 1)[-1]
    return None


def response_id(first: lm_pb2.GenerateResponse) -> str | None:
    """The id of a Responses API answer, from its first message: the JSON response, or a stream's
    first event (``response.created``, carrying the response)."""
    payload = first.openai
    if first.content_type.startswith("text/event-stream"):
        data = next((line[6:] for line in payload.split(b"\n") if line.startswith(b"data: ")), b"")
        try:
            return (json.loads(data).get("response") or {}).get("id")
        except (ValueError, AttributeError):
            return None
    try:
        out = json.loads(payload)
    except ValueError:
        return None
    return out.get("id") if isinstance(out, dict) else None
