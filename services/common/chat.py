"""Chat rendering shared by the LM service and the plain-vLLM reference runs,
so both feed vLLM the very same prompt text."""

from __future__ import annotations

from typing import Any


def render_chat(tokenizer, messages: list[dict[str, Any]]) -> str:
    """``messages``: [{"role", "content": str | [{"type": "text", "text"} | {"type": "image"}]}]."""
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def openai_to_hf(messages: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[str]]:
    """OpenAI chat messages -> (HF template messages, image URLs in prompt order).
    Used by the plain-vLLM reference; the gateway does the same through protos."""
    out, urls = [], []
    for m in messages:
        content = m["content"]
        if isinstance(content, str):
            out.append({"role": m["role"], "content": [{"type": "text", "text": content}]})
            continue
        parts = []
        for p in content:
            if p["type"] == "text":
                parts.append({"type": "text", "text": p["text"]})
            else:
                url = p["image_url"]["url"] if isinstance(p["image_url"], dict) else p["image_url"]
                urls.append(url)
                parts.append({"type": "image"})
        out.append({"role": m["role"], "content": parts})
    return out, urls
