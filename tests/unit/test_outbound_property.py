"""Property test of the producer's item lifecycle (issue 14): random interleavings of
encodes (each claiming the copy for its consumer), aborted encodes, Reserve -> header
(an in-place read begins), Ack, Cancel, stream loss and lease expiry, for two consumers
of one item, driven the way ``ectransfer.session`` drives ``OutboundStore`` (a session's
hold is the copy whose header it sent; Ack and Cancel name the consumer's claim and end
the read; a lost stream ends its reads with the lease restarted). After every step: no slot anyone still reads was freed, and no slot was
freed twice; at the end, once every consumer is gone and the leases have run out,
every slot was freed exactly once and the pool is empty."""

from __future__ import annotations

import time

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from ectransfer.outbound import CopyState, OutboundStore
from ectransfer.pool import Pool

pytestmark = pytest.mark.unit

ID = "item-1"
CONSUMERS = (0, 1)
CLAIMS = ("encode-0", "encode-1")  # each consumer's request came with its own Encode call


class _CountingPool(Pool):
    """A host pool that records every free: a second free of one slot is the bug. Slots are
    told apart by identity (one ``Slot`` object per allocation), not by value: the allocator
    hands the same offset out again once it is free."""

    def __init__(self) -> None:
        super().__init__(1 << 20)
        self.allocated: list = []
        self.freed: list = []

    def alloc(self, nbytes, timeout=None):
        slot = super().alloc(nbytes, timeout)
        self.allocated.append(slot)
        return slot

    def try_alloc(self, nbytes):
        slot = super().try_alloc(nbytes)
        if slot is not None:
            self.allocated.append(slot)
        return slot

    def was_freed(self, slot) -> bool:
        return any(s is slot for s in self.freed)

    def free(self, slot) -> None:
        assert not self.was_freed(slot), f"slot {slot} freed twice"
        assert any(s is slot for s in self.allocated), f"slot {slot} was never allocated"
        self.freed.append(slot)
        super().free(slot)


class Lifecycle(RuleBasedStateMachine):
    KEEP_BYTES = 0

    def __init__(self) -> None:
        super().__init__()
        self.pool = _CountingPool()
        self.store = OutboundStore(self.pool, ttl_s=60.0, keep_bytes=self.KEEP_BYTES)
        self.holds: dict[int, object] = {}  # consumer -> the copy (OutboundItem) it reads in place
        self.live: dict[int, object] = {}  # consumer -> the copy its unsettled claim holds
        self.settled: set[int] = set()  # consumers whose claim was acked, cancelled or aborted
        self.clock = time.monotonic()

    # -- the encoder ---------------------------------------------------------------

    @rule(c=st.sampled_from(CONSUMERS))
    def encode(self, c: int) -> None:
        """Consumer c's Encode includes the item: it claims the held copy, or its
        reservation is written and adopted for its claim."""
        if not self.store.claim(ID, CLAIMS[c]):
            slot = self.pool.alloc(1024)
            self.store.adopt(ID, slot, (4, 128), torch.bfloat16, (CLAIMS[c],))
        if c not in self.settled:
            self.live[c] = self.store.held(ID)
            assert self.live[c] is not None, "an unsettled claim's copy must be held"

    def _settled(self, c: int) -> None:
        self.settled.add(c)
        self.live.pop(c, None)

    def _expire(self) -> None:
        if ID in self.store.expire(now=self.clock):
            self.live.clear()  # the lease ran out: claims or not, the copy went

    @rule(c=st.sampled_from(CONSUMERS))
    def encode_aborted(self, c: int) -> None:
        """Consumer c's Encode call was cancelled: the encoder aborts it and its claim goes."""
        self.store.drop_claim(ID, CLAIMS[c])
        self._settled(c)

    @rule()
    def adopt_unclaimed(self) -> None:
        """A reservation lands after every claim on it was dropped (merged or freed at once)."""
        slot = self.pool.alloc(1024)
        self.store.adopt(ID, slot, (4, 128), torch.bfloat16, ())

    # -- a consumer's session ----------------------------------------------------------

    @rule(c=st.sampled_from(CONSUMERS))
    def header(self, c: int) -> None:
        """Reserve served: the header goes out and the consumer reads the slot in place."""
        if c in self.holds:
            return  # a duplicate Reserve while one is held: the session ignores it
        item = self.store.begin_send(ID, CLAIMS[c])
        if item is not None:
            self.holds[c] = item

    @rule(c=st.sampled_from(CONSUMERS), kind=st.sampled_from(["ack", "cancel"]))
    def release(self, c: int, kind: str) -> None:
        """Ack (read done) or Cancel (not wanted), naming c's claim (and the copy it read)."""
        held = self.holds.pop(c, None)
        if kind == "ack":
            self.store.ack(ID, CLAIMS[c], held.copy if held is not None else 0)
        else:
            self.store.cancel(ID, CLAIMS[c])
        self._settled(c)
        if held is not None:
            self.store.end_send(held)

    @rule(c=st.sampled_from(CONSUMERS))
    def lose_stream(self, c: int) -> None:
        """The consumer's stream breaks: its reads end, the lease restarts (it may still copy)."""
        held = self.holds.pop(c, None)
        if held is not None:
            self.store.end_send(held, lost=True)

    @precondition(lambda self: not self.holds)
    @rule()
    def lease_runs_out(self) -> None:
        """Time passes beyond the lease with nobody reading."""
        self.clock += self.store.ttl_s + 1
        self._expire()

    @rule(dt=st.sampled_from([0.0, 0.3, 1.0, 11.0]))
    def sweep(self, dt: float) -> None:
        """The producer's sweeper, a little later."""
        self.clock += dt
        self._expire()

    # -- what must hold -----------------------------------------------------------------

    @invariant()
    def nothing_read_was_freed(self) -> None:
        for c, item in self.holds.items():
            assert not self.pool.was_freed(item.slot), f"consumer {c} still reads {item.slot}, which was freed"

    @invariant()
    def no_copy_an_unsettled_claim_holds_was_freed(self) -> None:
        for c, item in self.live.items():
            assert not self.pool.was_freed(item.slot), f"consumer {c}'s claim is unsettled, its copy was freed"

    @invariant()
    def a_held_copy_is_claimed_read_or_pinned(self) -> None:
        item = self.store.held(ID)
        if item is not None:
            assert (item.claims or item.readers or item.pinned_until > time.monotonic() - 1
                    or item.state is CopyState.KEPT), item

    def teardown(self) -> None:
        for c in list(self.holds):
            self.lose_stream(c)
        for _ in range(2):  # lost readers keep their copy a lease; then everything goes
            self.clock += self.store.ttl_s + 1
            self.store.expire(now=self.clock)
        self.store.clear_tier()
        leaked = [s for s in self.pool.allocated if not self.pool.was_freed(s)]
        assert not leaked, f"never freed: {leaked}"
        assert self.pool.stats()["used_bytes"] == 0
        assert not self.store.contains(ID)


Lifecycle.TestCase.settings = settings(max_examples=400, stateful_step_count=40, deadline=None,
                                       suppress_health_check=[HealthCheck.too_slow])
test_item_lifecycle_frees_every_copy_once_and_never_one_being_read = Lifecycle.TestCase


class LifecycleWithTier(Lifecycle):
    """The same interleavings with the host tier on (room for one copy): a settled copy is kept, the next
    encode claims it back, and pressure on the pool evicts it; still nothing read or claimed is freed,
    nothing twice."""

    KEEP_BYTES = 1024

    @rule()
    def pool_pressure(self) -> None:
        """A reservation that needs the whole pool: the tier gives its kept copies back first."""
        slot = self.store.try_alloc(self.pool.capacity)
        if slot is not None:
            self.pool.free(slot)

    @invariant()
    def a_kept_copy_is_unclaimed_and_unread(self) -> None:
        item = self.store.held(ID)
        if item is not None and item.state is CopyState.KEPT:
            assert not item.claims and not item.readers, item
            assert self.store.kept() == (1, 1024)


LifecycleWithTier.TestCase.settings = Lifecycle.TestCase.settings
test_item_lifecycle_with_the_host_tier = LifecycleWithTier.TestCase
