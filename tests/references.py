"""Every request of the suite whose tokens a test compares with plain vLLM on the built-in tiny model,
in one table, so one plain-vLLM run answers them all (``tools.reference``, one subprocess started with
the session: ``tests/conftest.py``'s ``reference_run``). A run of its own per module was a vLLM start
each (seconds of CPU on a 2-core host while the deployments start beside it).

Names are unique across the table; each group says who sends it."""

from __future__ import annotations

from tests.e2e.helpers import conversation, image_chat, images_chat, perturb_chat, text_chat, text_conversation

# tests/e2e: the session deployment's tests and the deployments of their own that reuse these.
E2E = {
    "image0": image_chat(0),
    "image1": image_chat(1, text="Describe it."),
    "image2": image_chat(2, size=(200, 150)),
    "fresh": image_chat(1000),  # used by one test only: its encode must be a cache miss
    "fresh_shm": image_chat(1001, size=(200, 150)),  # likewise, for the transport test
    "reuse": image_chat(1002),  # likewise, for the reuse test
    "victim": image_chat(1003),  # likewise, for the trust-boundary test: never sent before its attack
    "colocated": image_chat(1004),  # likewise, for the colocated gateway: its LM must encode it itself
    **{f"perturb{i}": perturb_chat(9100 + i) for i in range(3)},  # the perturbation check's, never sent otherwise
    "text": text_chat("Tell me a story about a cat."),
    # tests/e2e/test_prefill_in_step.py: three images (the encoder's test hook delays the second).
    "late_item": images_chat([(9300, (112, 112)), (9301, (224, 224)), (9302, (112, 112))]),
    "late_cancelled": images_chat([(9310, (112, 112)), (9311, (224, 224)), (9312, (112, 112))]),
    "late_seeded": {**images_chat([(9320, (112, 112)), (9321, (224, 224)), (9322, (112, 112))]), "seed": 7},
    # The multi-instance tests (2 encoders, 2 LMs): larger images, so encodes are in flight long enough to kill.
    **{f"multi{i}": image_chat(600 + i, max_tokens=16, size=(224, 224)) for i in range(8)},
    # The multi-instance conversations (issue 33): turn t of conversation c, its history re-sent.
    **{f"conv{c}_{t}": body for c in range(3) for t, body in enumerate(conversation(620 + c, 3))},
    **{f"tconv_{t}": body for t, body in enumerate(text_conversation(3))},  # and one without an image
}

# tests/e2e/test_burst.py: request i of a burst is BURST[f"burst{i % BURST_DISTINCT}"]. 12 images and 5
# questions give 60 distinct bodies (12 and 5 are coprime), every one of the slow tier's 200.
BURST_IMAGES, BURST_QUESTIONS = 12, 5
BURST_DISTINCT = BURST_IMAGES * BURST_QUESTIONS
BURST = {f"burst{i}": image_chat(3000 + i % BURST_IMAGES, text=f"Question {i % BURST_QUESTIONS}?", max_tokens=6)
         for i in range(BURST_DISTINCT)}

# tests/multihost: each scenario uses images no other one sends (a seen image may be reused from an
# LM's encoder cache, with no transfer).
MULTIHOST = {
    "three": image_chat(700, max_tokens=8),
    "pod": image_chat(701, max_tokens=8),
    **{f"dns{i}": image_chat(710 + i, max_tokens=8) for i in range(16)},
    **{f"fault{i}": image_chat(750 + i, max_tokens=8) for i in range(24)},
    "pd": image_chat(790, max_tokens=8),
}

REFERENCE_REQUESTS: dict[str, dict] = {**E2E, **BURST, **MULTIHOST}
assert len(REFERENCE_REQUESTS) == len(E2E) + len(BURST) + len(MULTIHOST), "a name is in two groups"
