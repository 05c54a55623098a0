"""Plain vLLM on the same model, prompt and image: the oracle for exactness.

Runs each request alone through ``vllm.LLM`` with the engine settings the
services use (``EngineConfig`` defaults); chats go through vLLM's own chat
rendering (``LLM.chat``), as ``vllm serve`` renders them. Run it as a subprocess so its engine never shares a process with
anything else::

    python -m tools.reference --model DIR < requests.json > tokens.json

Input: a JSON list of OpenAI-style request bodies (chat ``messages`` with
image_url data URLs, or a completion ``prompt``; ``max_tokens``, ``temperature``,
``seed``, ``n``, ``logprobs``/``top_logprobs``; a ``chat_template`` the LM under test
was started with). Output: a JSON list, one entry per request: its token ids; with
``--with-prompts``, ``{"tokens": [...], "prompt_token_ids": [...]}`` (the prompt as
vLLM expanded it); for a request with ``n`` > 1 or logprobs, ``{"choices": [{"tokens",
"logprobs"}], "prompt_token_ids"}`` (each sampled token's logprob).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

from services.common.engine import EngineConfig, configure_process_env, engine_kwargs
from services.common.spawn import child_env


def run(model: str, requests: list[dict], with_prompts: bool = False) -> list:
    configure_process_env()  # before vLLM is imported
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM, SamplingParams

    llm = LLM(**engine_kwargs(EngineConfig(model=model)))
    results = []
    for body in requests:
        top = body.get("top_logprobs", 0) if body.get("logprobs") else None
        params = SamplingParams(temperature=body.get("temperature", 0.0), max_tokens=body.get("max_tokens", 16),
                                seed=body.get("seed"), n=body.get("n", 1), logprobs=top)
        if "messages" in body:
            out = llm.chat(body["messages"], params, use_tqdm=False, chat_template=body.get("chat_template"))
        else:
            out = llm.generate({"prompt": body["prompt"]}, params, use_tqdm=False)
        tokens = list(out[0].outputs[0].token_ids)
        if params.n > 1 or top is not None:  # every choice, each token's logprob
            results.append({"choices": [
                {"tokens": list(c.token_ids),
                 "logprobs": [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)] if c.logprobs else None}
                for c in out[0].outputs], "prompt_token_ids": list(out[0].prompt_token_ids)})
        else:
            results.append({"tokens": tokens, "prompt_token_ids": list(out[0].prompt_token_ids)} if with_prompts
                           else tokens)
    return results


class Run:
    """A reference run in its own interpreter (``launch``): ``result`` waits for it and returns ``run``'s
    result. Its output and log go to files, never to a pipe nobody reads yet (vLLM logs more than a pipe
    holds, and the run would stall until ``result`` is called)."""

    def __init__(self, proc: subprocess.Popen, out, err) -> None:
        self.proc, self._out, self._err = proc, out, err

    def result(self, timeout: float = 600) -> list:
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise
        self._out.seek(0)
        self._err.seek(0)
        out, err = self._out.read().decode(), self._err.read().decode(errors="replace")
        if code != 0:
            raise RuntimeError(f"reference run failed:\n{err[-3000:]}")
        return json.loads(out.strip().splitlines()[-1])

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def launch(model: str, requests: list[dict], with_prompts: bool = False, prefix: tuple[str, ...] = ()) -> Run:
    """Starts ``run`` in a fresh interpreter (``prefix``: a command to run it under, e.g. ``nice -n 10``)."""
    argv = [*prefix, sys.executable, "-m", "tools.reference", "--model", model,
            *(["--with-prompts"] if with_prompts else [])]
    stdin, out, err = tempfile.TemporaryFile(), tempfile.TemporaryFile(), tempfile.TemporaryFile()
    stdin.write(json.dumps(requests).encode())
    stdin.seek(0)
    proc = subprocess.Popen(argv, stdin=stdin, stdout=out, stderr=err,
                            env=child_env())  # often from a worker thread: services/common/spawn.py
    stdin.close()
    return Run(proc, out, err)


def run_subprocess(model: str, requests: list[dict], timeout: float = 600, with_prompts: bool = False) -> list:
    """Runs ``run`` in a fresh interpreter and returns its result."""
    return launch(model, requests, with_prompts).result(timeout)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--with-prompts", action="store_true", help="also each prompt's token ids as vLLM expanded it")
    ns = p.parse_args()
    tokens = run(ns.model, json.load(sys.stdin), with_prompts=ns.with_prompts)
    sys.stdout.write("\n" + json.dumps(tokens) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
