"""Test-only hook: with ``EPD_TEST_PERTURB_SWITCH=<path>`` in a process's environment, the LM
worker's connector negates and scales every embedding it injects into vLLM's encoder cache while
the file ``<path>`` exists, and appends each identifier it changed to ``EPD_TEST_PERTURB_LOG``.
Loaded only when a test puts this directory on ``PYTHONPATH`` (the e2e session deployment and the
family deployments, for ``test_an_embedding_changed_in_transit_changes_the_tokens``); production
code has no such hook. Off (no file), it changes nothing."""

import importlib.abc
import os
import sys

_TARGET = "ectransfer.connector.consumer"


def _patch(module) -> None:
    load = module.ConsumerWorker.load
    switch = os.environ["EPD_TEST_PERTURB_SWITCH"]
    log = os.environ.get("EPD_TEST_PERTURB_LOG", "")

    def perturbed(self, encoder_cache, meta):
        load(self, encoder_cache, meta)
        if not meta.loads or not os.path.exists(switch):
            return
        for spec in meta.loads:
            t = encoder_cache.get(spec.identifier)
            if t is not None:
                encoder_cache[spec.identifier] = t * -3
                if log:
                    with open(log, "a") as f:
                        f.write(spec.identifier + "\n")

    module.ConsumerWorker.load = perturbed


class _Hook(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != _TARGET:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        else:
            return None
        exec_module = spec.loader.exec_module

        def run(module):
            exec_module(module)
            _patch(module)

        spec.loader.exec_module = run
        return spec


if os.environ.get("EPD_TEST_PERTURB_SWITCH"):
    sys.meta_path.insert(0, _Hook())
