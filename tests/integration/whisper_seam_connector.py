"""The consumer connector of tests/integration/test_whisper_apart_seam.py: vLLM's file-based
``ECExampleConnector`` (the producer writes each encoder output to a file named by its mm_hash) with
the scheduler-half rule issue 35's path needs for an encoder-decoder model: an item whose output is on
disk is left to vLLM's local path (``has_cache_item`` says no, so vLLM allocates its cross-attention
blocks) and loaded when vLLM allocates it (``update_state_after_alloc``). ``SEAM_NEGATE=1`` negates and
scales every output it loads (the perturbation technique)."""

from __future__ import annotations

import os

from vllm.distributed.ec_transfer.ec_connector.example_connector import ECExampleConnector


class SeamConsumer(ECExampleConnector):
    def has_cache_item(self, identifier: str) -> bool:
        return False

    def update_state_after_alloc(self, request, index: int) -> None:
        mm_hash = request.mm_features[index].identifier
        if self.is_consumer and self._found_match_for_mm_data(mm_hash):
            self._mm_datas_need_loads[mm_hash] = request.get_num_encoder_embeds(index)

    def start_load_caches(self, encoder_cache, **kwargs) -> None:
        before = set(encoder_cache)
        super().start_load_caches(encoder_cache, **kwargs)
        loaded = set(encoder_cache) - before
        with open(os.environ["SEAM_LOG"], "a") as f:
            f.writelines(h + "\n" for h in sorted(loaded))
        if os.environ.get("SEAM_NEGATE") == "1":
            for h in loaded:
                encoder_cache[h] = encoder_cache[h] * -3
