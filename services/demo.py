"""``make demo``: start epd-serve on the tiny model, send an image+text chat and
a text request through the gateway with the official ``openai`` client, print
answers and per-stage timings, check the tokens against plain vLLM, shut down.
"""

from __future__ import annotations

import sys
import time

from openai import OpenAI

from services.cli import default_model, use_checkout_tools
from services.up import Deployment


def main() -> int:
    model = default_model()
    use_checkout_tools()  # the demo's image and its plain-vLLM reference are the checkout's tooling
    from tools.media import data_url, make_image
    from tools.reference import run_subprocess

    image = data_url(make_image(seed=7, size=(160, 120)))
    requests = [
        {"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": image}},
            {"type": "text", "text": "What is in this picture?"}]}], "max_tokens": 24, "temperature": 0,
         "return_token_ids": True},
        {"messages": [{"role": "user", "content": "Write one sentence about the sea."}],
         "max_tokens": 24, "temperature": 0, "return_token_ids": True},
    ]
    print("The built-in tiny model has random weights: its words are random, by design.\n"
          "What matters is that epd-serve returns exactly the tokens plain vLLM returns.\n")
    results = []
    with Deployment(model=model) as dep:
        client = OpenAI(base_url=dep.url + "/v1", api_key="unused")
        served = client.models.list().data[0].id
        for label, body in zip(("image + text", "text only"), requests):
            t0 = time.perf_counter()
            fields = {k: v for k, v in body.items() if k != "return_token_ids"}
            resp = client.chat.completions.create(model=served, extra_body={"return_token_ids": True}, **fields)
            wall = (time.perf_counter() - t0) * 1e3
            extra = resp.model_extra.get("epd", {})
            t = extra.get("timings", {})
            choice = resp.choices[0]
            results.append(choice.model_extra["token_ids"])
            print(f"[{label}] {choice.message.content!r}")
            print(f"    encode {t.get('encode_ms', 0):.1f} ms | transfer {t.get('transfer_ms', 0):.1f} ms | "
                  f"TTFT {t.get('ttft_ms', 0):.1f} ms | total {wall:.1f} ms | "
                  f"LM vision-encoder runs {extra.get('local_encoder_runs', 0)}, "
                  f"items transferred {extra.get('transferred_items', 0)}")
    print("\nplain vLLM on the same requests ...", flush=True)
    reference = run_subprocess(model, requests)
    ok = True
    for label, got, want in zip(("image + text", "text only"), results, reference):
        same = got == want
        ok &= same
        print(f"[{label}] tokens {'MATCH' if same else 'DIFFER'} plain vLLM ({len(got)} tokens)")
        if not same:
            print(f"    epd-serve: {got}\n    vLLM:      {want}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
