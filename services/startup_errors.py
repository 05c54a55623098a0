"""Why an ``epd`` command could not start, said in words a user can act on.

A service that cannot start used to end in a traceback (a model missing from the Hugging Face cache
surfaced as huggingface_hub's ``LocalEntryNotFoundError`` inside vLLM's argument parsing, and
``epd up`` wrapped it in its own). ``StartupError`` is the short form: what is wrong, and what to do,
one line each. Who makes one:

- ``explain`` reads an exception raised while a service started (its whole chain of causes) and
  returns the ``StartupError`` for the causes users meet: a model not in the cache while downloads
  are off (or that could not be downloaded), a model directory that does not exist or holds no
  model, a model name the Hub does not know, a port in use. Anything else: None, and the caller lets
  the exception go on with its traceback.
- ``check_port`` refuses a port that something already listens on, before a service spends minutes
  starting an engine only to fail at its bind; ``check_model`` a model directory that does not exist,
  before vLLM is imported.

``services.cli`` prints a ``StartupError`` as the command's last lines (``ERROR_PREFIX``) after
logging the traceback, so the traceback is in the service's log and the reason is at its end;
``services.child`` reads those lines back from a child's log (``summary_from_log``), so ``epd up``
shows them instead of the log's tail. Importing this module imports neither vLLM nor
huggingface_hub (exceptions are recognised by class name): the gateway uses it too.
"""

from __future__ import annotations

import errno
import os
import re
import socket
from collections.abc import Iterator, Mapping

ERROR_PREFIX = "epd: error: "
"""How ``epd`` starts the line that says why it could not start (the next line, indented, what to do)."""
_ERROR_LINE = re.compile(r"^epd(?: [a-z-]+)?: error: ")
"""``ERROR_PREFIX``, or argparse's ``epd lm: error: `` for a bad flag."""

MISSING_OFFLINE = ("LocalEntryNotFoundError", "OfflineModeIsEnabled")
"""huggingface_hub's exceptions for a model that is not in the cache (downloads off or failed)."""
NOT_ON_HUB = ("RepositoryNotFoundError", "RevisionNotFoundError")
GATED = ("GatedRepoError",)
BAD_NAME = ("HFValidationError",)
NO_MODEL_HERE = "Invalid repository ID or local directory"
"""vLLM's words for a directory without a model configuration."""
IN_USE = "address already in use"
"""How a bind to a port in use fails (aiohttp's and the kernel's words, lower case)."""
BIND_FAILED = ("failed to bind to address", "cannot bind")
"""How grpc and our own servers say a bind failed, whatever the reason (lower case)."""


class StartupError(Exception):
    """What is wrong (``what``) and what to do (``todo``); ``str()`` is the two lines ``epd`` prints."""

    def __init__(self, what: str, todo: str = "") -> None:
        super().__init__(what)
        self.what, self.todo = what, todo

    def __str__(self) -> str:
        return self.what + (f"\n  {self.todo}" if self.todo else "")


def _chain(exc: BaseException | None) -> Iterator[BaseException]:
    """``exc`` and its causes (``raise ... from``) and contexts, innermost last; each once."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def _is(exc: BaseException, names: tuple[str, ...]) -> bool:
    return any(c.__name__ in names for c in type(exc).__mro__)


def _looks_like_path(model: str) -> bool:
    """A model given as a directory rather than a Hub name (``org/name``): absolute, relative to
    here or home, or with more than one ``/``."""
    return model.startswith(("/", "./", "../", "~")) or model.count("/") > 1


def explain(exc: BaseException, model: str = "", environ: Mapping[str, str] = os.environ) -> StartupError | None:
    """The ``StartupError`` for ``exc`` (raised while a service of ``model`` started), or None for
    a cause this module does not know. ``environ``: where ``HF_HUB_OFFLINE`` is read."""
    if isinstance(exc, StartupError):
        return exc
    chain = list(_chain(exc))
    if model and any(_is(e, MISSING_OFFLINE + NOT_ON_HUB + BAD_NAME) or NO_MODEL_HERE in str(e) for e in chain):
        return _model_error(chain, model, environ)
    ports = "--port, --grpc-port, --metrics-port, --transfer-port or --kv-port"
    for e in chain:
        if (isinstance(e, OSError) and e.errno == errno.EADDRINUSE) or IN_USE in str(e).lower():
            return StartupError(f"a port this service must listen on is in use ({_first_line(e)})",
                                f"stop the program that holds it (`ss -ltnp` names it), or pass another {ports}")
        if any(p in str(e).lower() for p in BIND_FAILED):
            return StartupError(f"this service cannot listen where it was told to ({_first_line(e)})",
                                f"check that the host is an address of this machine and the port is free "
                                f"(`ss -ltnp`), or pass another {ports}")
    return None


def _model_error(chain: list[BaseException], model: str, environ: Mapping[str, str]) -> StartupError:
    path = os.path.expanduser(model)
    if os.path.isdir(path):
        return StartupError(f"model directory {model} holds no model vLLM recognises (no config.json)",
                            "pass the directory that holds the model's config.json and weights")
    if _looks_like_path(model) or any(_is(e, BAD_NAME) for e in chain):
        return StartupError(f"model {model}: no such directory, and not a Hugging Face model name (org/name)",
                            "pass a model directory that exists, or a model name such as Qwen/Qwen2-VL-2B-Instruct")
    if any(_is(e, GATED) for e in chain):
        return StartupError(f"model {model} is gated on the Hugging Face Hub",
                            "accept its terms on huggingface.co and log in (huggingface-cli login, or HF_TOKEN)")
    if any(_is(e, NOT_ON_HUB) for e in chain):
        return StartupError(f"model {model}: the Hugging Face Hub has no such model (or it is private)",
                            "check the name, or log in (huggingface-cli login, or HF_TOKEN) for a private model")
    if environ.get("HF_HUB_OFFLINE", "1").lower() not in ("0", "false", "no", "off", ""):
        return StartupError(f"model {model} is not in this machine's Hugging Face cache, and epd does not "
                            "download (HF_HUB_OFFLINE=1 unless you set it)",
                            f"download it first (huggingface-cli download {model}), or export HF_HUB_OFFLINE=0 "
                            "TRANSFORMERS_OFFLINE=0 to let the services download it")
    return StartupError(f"model {model} is not in this machine's Hugging Face cache and could not be downloaded",
                        "check this machine's network (and HF_ENDPOINT, proxies), or download it where you can "
                        "and copy the cache (HF_HOME)")


def check_model(model: str) -> None:
    """Refuses (``StartupError``) a model given as a directory that does not exist, at once: before
    vLLM is imported and asked (which says the same, with a traceback, seconds later)."""
    if _looks_like_path(model) and not os.path.exists(os.path.expanduser(model)):
        raise _model_error([], model, {})


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def check_port(flag: str, host: str, port: int) -> None:
    """Refuses (``StartupError``) ``port`` on ``host`` when something listens there already, so the
    service says so before it starts an engine. Port 0 (any free one) is never refused. The probe
    binds as the servers do (SO_REUSEADDR: a port with only closed connections in TIME_WAIT is free)
    but without SO_REUSEPORT, so a port another gRPC server holds is refused rather than shared.
    Only a probe: the service's own bind still decides, and ``explain`` reads its failure."""
    if not port:
        return
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror:
        return  # a host that does not resolve: the service's bind says so
    family, kind, proto, _, addr = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(addr)
        except OSError as e:
            if e.errno != errno.EADDRINUSE:
                return  # not ours to judge (an address this host does not have): the bind says so
            raise StartupError(f"{flag} {port}: {host}:{port} is in use",
                               f"stop the program that listens there (`ss -ltnp 'sport = :{port}'` names it), "
                               f"or pass another {flag}") from None


def summary_from_log(text: str) -> str:
    """The lines a failed ``epd`` command printed to say why (its last ``epd...: error:`` line and the
    indented lines after it), or "" when it printed none (it crashed some other way)."""
    lines = text.rstrip().splitlines()
    for i in range(len(lines) - 1, -1, -1):
        if _ERROR_LINE.match(lines[i]):
            end = i + 1
            while end < len(lines) and lines[end].startswith("  "):
                end += 1
            return "\n".join(lines[i:end])
    return ""
