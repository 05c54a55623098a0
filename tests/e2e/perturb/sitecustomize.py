"""Test-only hooks, loaded only when a test puts this directory on ``PYTHONPATH`` (the e2e session
deployment and the family deployments); production code has no such hook. Each is off until its switch
file exists, and then changes only what it names.

- ``EPD_TEST_PERTURB_SWITCH=<path>``: the LM worker's connector negates and scales every embedding it
  injects into vLLM's encoder cache while ``<path>`` exists, and appends each identifier it changed to
  ``EPD_TEST_PERTURB_LOG`` (``test_an_embedding_changed_in_transit_changes_the_tokens``).
- ``EPD_TEST_DELAY_SWITCH=<path>``: while ``<path>`` exists and holds "<k> <seconds>", the encoder's
  worker reports the k-th output (from 0, in prompt order) of each engine step that saves more than k
  that many seconds late (its engine goes on meanwhile): a slow item among fast ones
  (tests/e2e/test_prefill_in_step.py)."""

import importlib.abc
import os
import sys
import threading


def _perturb(module) -> None:
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


def _delay(module) -> None:
    begin_step, save = module.ProducerWorker.begin_step, module.ProducerWorker.save
    switch = os.environ["EPD_TEST_DELAY_SWITCH"]

    def began(self, encoder_cache, meta):
        self._test_order = [spec.identifier for spec in meta.saves]  # this step's outputs, in prompt order
        return begin_step(self, encoder_cache, meta)

    def delayed(self, encoder_cache, mm_hash):
        try:
            with open(switch) as f:
                index, seconds = f.read().split()
        except (OSError, ValueError):
            return save(self, encoder_cache, mm_hash)
        order = getattr(self, "_test_order", [])
        if int(index) >= len(order) or order[int(index)] != mm_hash:
            return save(self, encoder_cache, mm_hash)
        report = self._report
        self._report = lambda r: threading.Timer(float(seconds), report, (r,)).start()
        try:
            return save(self, encoder_cache, mm_hash)
        finally:
            del self._report  # the class's method again

    module.ProducerWorker.begin_step = began
    module.ProducerWorker.save = delayed


_TARGETS = {}
if os.environ.get("EPD_TEST_PERTURB_SWITCH"):
    _TARGETS["ectransfer.connector.consumer"] = _perturb
if os.environ.get("EPD_TEST_DELAY_SWITCH"):
    _TARGETS["ectransfer.connector.producer"] = _delay


class _Hook(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        patch = _TARGETS.get(name)
        if patch is None:
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
            patch(module)

        spec.loader.exec_module = run
        return spec


if _TARGETS:
    sys.meta_path.insert(0, _Hook())
