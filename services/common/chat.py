"""Chat rendering shared by the LM service and the plain-vLLM reference runs,
so both feed vLLM the very same prompt text."""

from __future__ import annotations

from typing import Any


def render_chat(tokenizer, messages: list[dict[str, Any]]) -> str:
    """``messages``: [{"role", "content": str | [{"type": "text", "text"} | {"type": "image"}]}]."""
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
