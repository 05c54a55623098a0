"""A request's prompt prefixes as keys the gateway can route by: pure functions, tested alone
(``tests/unit/test_fleet_memory.py``).

The gateway cannot compute vLLM's block hashes (it does not tokenize, and vLLM seeds its hashes per
process), so it names prefixes itself: a chain of digests over the request's conversation, one per message
(chat, Anthropic Messages, a Responses input list) or per ``CHUNK_CHARS`` of a completions prompt, each
digest over the one before and that element (its media parts replaced by their content hashes), the first
seeded with what else shapes the rendered prompt (the model, the tenant's ``cache_salt``, tools, a chat
template). A follow-up turn re-sends its history, so its chain starts with every key of the turn before.

The LM learns the last key of each request it serves (``GenerateRequest.prefix_key``) and hands it to vLLM
as the request's ``session_id``; vLLM publishes it on every KV block the request stores, so the LM's
``Holdings`` says which keys its prefix cache holds from vLLM's own events, and drops a key when its blocks
are evicted. Only routing reads a key: one the gateway derives differently from how the LM renders the
prompt costs a miss, never a wrong answer.

A key's weight is an estimate of the prompt tokens up to it (``CHARS_PER_TOKEN`` characters a token, and
``ITEM_TOKENS`` a media item: the gateway routes before any encoder has laid an item out)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

CHUNK_CHARS = 512
"""A completions prompt's element: its text in chunks of this many characters (token ids: a quarter)."""
CHARS_PER_TOKEN = 4
ITEM_TOKENS = 256
"""A media item's prompt tokens, as routing estimates them (vLLM lays an image out in tens to thousands)."""
MIN_TOKENS = 32
"""A prefix shorter than this (estimated) has no key: it would save no whole KV block (16 tokens on a GPU,
128 on vLLM's CPU backend) worth steering for, and keying it would pin every request with the same short
prompt to one LM."""
MAX_KEYS = 256
"""A request's keys past this many are not derived (a longer conversation matches on its first 256)."""
SEED_FIELDS = ("model", "cache_salt", "tools", "chat_template", "chat_template_kwargs", "system", "instructions")
"""Top-level body fields that shape the rendered prompt before its first element."""
KEY_PREFIX = "p:"
"""Prefix keys and media identifiers share a directory; an identifier is hex, so never starts with this."""


@dataclass(frozen=True)
class Prefix:
    """A request's prefix keys, shortest first, with the estimated tokens and the media items up to each."""

    keys: tuple[str, ...] = ()
    tokens: tuple[int, ...] = ()
    items: tuple[int, ...] = ()

    @property
    def last(self) -> str:
        """The key of the whole prompt (of its last whole chunk, for completions): the LM's session id."""
        return self.keys[-1] if self.keys else ""


NONE = Prefix()


def feed(h, value: Any) -> None:
    """``value`` (what JSON decodes to) into the hash ``h``, each part tagged with its type and length, so
    two values feed the same bytes only if they are equal (a dict's keys in sorted order; anything else
    as its ``str``). A string goes in as its UTF-8 bytes, without JSON's escaping pass: a 32 MiB text
    costs one encode (a copy) and a hash, which releases the GIL."""
    if isinstance(value, str):
        data = value.encode("utf-8", "surrogatepass")
        h.update(b"s%d:" % len(data))
        h.update(data)
    elif isinstance(value, dict):
        h.update(b"d%d:" % len(value))
        for k in sorted(value, key=str):
            feed(h, str(k))
            feed(h, value[k])
    elif isinstance(value, (list, tuple)):
        h.update(b"l%d:" % len(value))
        for v in value:
            feed(h, v)
    elif value is None or isinstance(value, (bool, int, float)):
        h.update(b"v" + json.dumps(value).encode() + b";")  # null, true, 1, 1.5: JSON's own spelling
    else:
        feed(h, f"{type(value).__name__}:{value}")


def _digest(parent: str, element: Any) -> str:
    h = hashlib.sha256(parent.encode() + b"\x00")
    feed(h, element)
    return KEY_PREFIX + h.hexdigest()[:32]


def _chain(seed: Any, elements: Sequence[tuple[Any, int, int]]) -> Prefix:
    """``elements``: (what is hashed, its estimated tokens, its media items) in prompt order."""
    keys, tokens, items = [], [], []
    parent, t, n = _digest("", seed), 0, 0
    for element, el_tokens, el_items in elements[:MAX_KEYS]:
        parent = _digest(parent, element)
        t, n = t + el_tokens, n + el_items
        if t < MIN_TOKENS:
            continue
        keys.append(parent)
        tokens.append(t)
        items.append(n)
    return Prefix(tuple(keys), tuple(tokens), tuple(items))


def _text_tokens(value: Any) -> int:
    if isinstance(value, str):
        return len(value) // CHARS_PER_TOKEN
    if isinstance(value, dict):
        return sum(_text_tokens(v) for v in value.values())
    if isinstance(value, list):
        return sum(_text_tokens(v) for v in value)
    return 0


def of_request(api: str, body: dict[str, Any], media_at: dict[tuple[str, int, str, int], str],
               salt: Any = None) -> Prefix:
    """The prefix keys of a request to ``api`` ("completions", or one whose conversation is a list of
    ``messages`` or ``input`` elements) with JSON ``body``. ``media_at``: each media part's place
    (container, element, key, part) -> its content hash. ``salt``: the ``cache_salt`` the LM will see (the
    tenant's). A request with no conversation the gateway can read has no keys."""
    if not isinstance(body, dict):
        return NONE
    seed = {f: body.get(f) for f in SEED_FIELDS if body.get(f) is not None}
    if salt is not None:
        seed["cache_salt"] = salt
    if api == "completions":
        return _chain(seed, _prompt_chunks(body.get("prompt")))
    container = "input" if isinstance(body.get("input"), (list, str)) and "messages" not in body else "messages"
    elements = body.get(container)
    if isinstance(elements, str) and container == "input":  # a Responses input may be one string
        elements = [{"role": "user", "content": elements}]
    if not isinstance(elements, list):
        return NONE
    out = []
    for i, element in enumerate(elements[:MAX_KEYS]):
        n = 0
        if isinstance(element, dict):
            element = dict(element)
            for key, parts in element.items():
                if not isinstance(parts, list):
                    continue
                ids = {p: media_at[(container, i, key, p)] for p in range(len(parts)) if (container, i, key, p) in media_at}
                if ids:  # a media part is known by its content hash, however the client sent it
                    element[key] = [{"media": ids[p]} if p in ids else part for p, part in enumerate(parts)]
                    n += len(ids)
        out.append((element, _text_tokens(element) + n * ITEM_TOKENS, n))
    return _chain(seed, out)


def _prompt_chunks(prompt: Any) -> list[tuple[Any, int, int]]:
    """A completions prompt's whole chunks (a partial last chunk has no key: the next turn's prompt
    continues it). A batch of prompts has none."""
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if isinstance(prompt, str):
        size, per = CHUNK_CHARS, CHUNK_CHARS // CHARS_PER_TOKEN
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        size = per = CHUNK_CHARS // CHARS_PER_TOKEN
    else:
        return []
    return [(prompt[s:s + size], per, 0) for s in range(0, len(prompt) - size + 1, size)]
