"""The endpoints of ``vllm serve`` that epd-serve answers: one table (``APIS``) that the gateway and the
LM both read, so the routes the gateway forwards and the routes the LM's copy of vLLM's app answers
cannot disagree.

The gateway routes every row (``services.gateway.openai_api``) and reads its body by the row
(``services.gateway.request``); the LM answers the rows whose ``lm_api`` is ``http`` through vLLM's own
app, by method and path (``services.lm.vllm_app.ROUTES``, from ``lm_app_routes``). Importing this
module imports neither vLLM nor torch (the gateway loads neither)."""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Api:
    """One endpoint of ``vllm serve`` the gateway answers. Chat and completions go to the LM's serving
    classes by name; every other one to the LM's copy of vLLM's own app (``services.lm.vllm_app``) by
    method and path. ``media``: where its media are (``messages``: chat parts; ``input``: the
    Responses API's input items; ``anthropic``: Messages image blocks; empty: none). ``encode``: its
    items go through encoders (tokenize and count_tokens only lay prompts out: the LM's processor
    expands the placeholders, no vision run). ``done``: its stream ends with ``data: [DONE]``.
    ``upload``: its body is a ``multipart/form-data`` upload (the audio routes of an encoder-decoder
    model), which the gateway forwards as it came, under the intake's size bound, and never parses: its
    readers are vLLM's app on the LM and, where an encoder cuts speech windows, that encoder, which reads
    it by the same rule with vLLM's own code (``services.encoder.speech``); the body goes to both as one
    item (``Media.content_type``)."""

    name: str
    method: str
    path: str
    prefix: str
    media: str = ""
    encode: bool = True
    done: bool = False
    anthropic: bool = False
    upload: bool = False
    generates: bool = False
    """It generates text from a prompt: it goes E -> P -> D where the deployment has prefill and decode LMs
    (the others, tokenize or a stored response's GET, are answered by one LM)."""

    @property
    def lm_api(self) -> str:
        return self.name if self.name in ("chat", "completions") else "http"


APIS: tuple[Api, ...] = (
    Api("chat", "POST", "/v1/chat/completions", "chatcmpl", "messages", done=True, generates=True),
    Api("completions", "POST", "/v1/completions", "cmpl", done=True, generates=True),
    Api("responses", "POST", "/v1/responses", "resp", "input", generates=True),
    Api("responses_get", "GET", "/v1/responses/{response_id}", "resp"),
    Api("responses_cancel", "POST", "/v1/responses/{response_id}/cancel", "resp"),
    Api("messages", "POST", "/v1/messages", "msg", "anthropic", anthropic=True, generates=True),
    Api("count_tokens", "POST", "/v1/messages/count_tokens", "msg", "anthropic", encode=False, anthropic=True),
    Api("tokenize", "POST", "/tokenize", "tok", "messages", encode=False),
    Api("detokenize", "POST", "/detokenize", "tok"),
    Api("version", "GET", "/version", "req"),
    Api("transcriptions", "POST", "/v1/audio/transcriptions", "trsc", encode=False, upload=True),
    Api("translations", "POST", "/v1/audio/translations", "trsl", encode=False, upload=True),
)
API = {a.name: a for a in APIS}

PATH_PARAM = r"[A-Za-z0-9_.-]{1,200}"
"""What the LM accepts for a ``{name}`` segment of a path (a stored response's id): a bounded run of
URL-safe characters, never a ``/``."""


def path_pattern(path: str) -> re.Pattern[str]:
    """``path`` (aiohttp's form, ``/v1/responses/{response_id}``) as a full-match pattern: each literal
    part escaped, each ``{name}`` segment ``PATH_PARAM``."""
    parts = re.split(r"\{[A-Za-z_]+\}", path)
    return re.compile(PATH_PARAM.join(re.escape(p) for p in parts))


def lm_app_routes() -> tuple[tuple[str, re.Pattern[str], bool], ...]:
    """The routes the LM's copy of vLLM's app answers (method, full-match path, whether the body is an
    upload): every endpoint the gateway forwards to it, and nothing else."""
    return tuple((a.method, path_pattern(a.path), a.upload) for a in APIS if a.lm_api == "http")
