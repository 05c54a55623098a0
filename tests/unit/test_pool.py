"""OffsetAllocator arithmetic and the thread-safe, bounded Pool around it."""

import itertools
import random
import threading

import pytest
import torch

from ectransfer.pool import OffsetAllocator, Pool, PoolFullError

pytestmark = pytest.mark.unit

A = 256  # alignment used throughout


def rounded(n: int) -> int:
    return max(A, -(-n // A) * A)


# --- OffsetAllocator -------------------------------------------------------------------------------------------


def test_alloc_rounds_every_request_up_to_the_alignment():
    a = OffsetAllocator(8 * A, alignment=A)
    assert a.alloc(1) == 0
    assert a.alloc(A) == A
    assert a.alloc(A + 1) == 2 * A  # takes two units
    assert a.alloc(0) == 4 * A  # even zero bytes take one unit
    assert a.used_bytes == 5 * A
    assert a.free_bytes == 3 * A
    assert a.num_allocations == 4


def test_first_fit_takes_the_lowest_hole_that_is_big_enough():
    a = OffsetAllocator(4 * A, alignment=A)
    assert [a.alloc(A) for _ in range(4)] == [0, A, 2 * A, 3 * A]
    assert a.alloc(1) is None
    a.free(0)  # hole of one unit at 0
    a.free(2 * A)
    a.free(3 * A)  # hole of two units at 2A
    assert a.alloc(2 * A) == 2 * A  # skips the small hole
    assert a.alloc(A) == 0


@pytest.mark.parametrize(
    "free_order, merged_size, merged_offset",
    [
        ((0, A), 2 * A, 0),  # B joins its free left neighbour
        ((2 * A, A), 2 * A, A),  # B joins its free right neighbour
        ((0, 2 * A, A), 3 * A, 0),  # B joins both
    ],
    ids=["left", "right", "both"],
)
def test_free_coalesces_with_neighbours(free_order, merged_size, merged_offset):
    a = OffsetAllocator(3 * A, alignment=A)
    assert [a.alloc(A) for _ in range(3)] == [0, A, 2 * A]
    for off in free_order:
        a.free(off)
    assert a.alloc(merged_size) == merged_offset


@pytest.mark.parametrize("seed", range(5))
def test_whole_capacity_is_one_range_again_after_freeing_everything_in_any_order(seed):
    rng = random.Random(seed)
    a = OffsetAllocator(64 * A, alignment=A)
    offsets = []
    while (off := a.alloc(rng.randint(0, 3 * A))) is not None:
        offsets.append(off)
    rng.shuffle(offsets)
    for off in offsets:
        a.free(off)
    assert a.used_bytes == 0 and a.num_allocations == 0
    assert a.alloc(64 * A) == 0


def test_double_free_and_unknown_offset_raise_keyerror():
    a = OffsetAllocator(4 * A, alignment=A)
    off = a.alloc(10)
    a.free(off)
    with pytest.raises(KeyError):
        a.free(off)
    with pytest.raises(KeyError):
        a.free(A)  # never handed out
    assert a.used_bytes == 0


@pytest.mark.parametrize("capacity", [0, -1])
def test_capacity_must_be_positive(capacity):
    with pytest.raises(ValueError, match="capacity"):
        OffsetAllocator(capacity)


@pytest.mark.parametrize("alignment", [0, -256, 3, 100, 257])
def test_alignment_must_be_a_power_of_two(alignment):
    with pytest.raises(ValueError, match="power of two"):
        OffsetAllocator(1024, alignment=alignment)


def test_alignment_one_gives_exact_sizes_and_negative_sizes_are_rejected():
    a = OffsetAllocator(10, alignment=1)
    assert a.alloc(3) == 0 and a.alloc(7) == 3
    assert a.free_bytes == 0
    with pytest.raises(ValueError):
        a.alloc(-1)


# --- Pool ------------------------------------------------------------------------------------------------------


def test_try_alloc_returns_none_when_full_and_succeeds_after_a_free():
    pool = Pool(2 * A, alignment=A)
    s1, s2 = pool.try_alloc(A), pool.try_alloc(A)
    assert s1 is not None and s2 is not None
    assert pool.try_alloc(1) is None
    pool.free(s1)
    again = pool.try_alloc(1)
    assert again is not None and again.offset == s1.offset and again.nbytes == 1


def test_alloc_blocks_until_another_thread_frees():
    pool = Pool(4 * A, alignment=A)
    held = pool.alloc(4 * A)
    timer = threading.Timer(0.05, pool.free, args=(held,))
    timer.start()
    try:
        slot = pool.alloc(4 * A, timeout=30)  # waits for the timer's free
    finally:
        timer.join()
    assert (slot.offset, slot.nbytes) == (0, 4 * A)
    assert pool.stats()["allocations"] == 1


@pytest.mark.parametrize("timeout", [0, 0.05])
def test_alloc_raises_poolfull_when_the_timeout_passes(timeout):
    pool = Pool(2 * A, alignment=A)
    pool.alloc(2 * A)
    with pytest.raises(PoolFullError, match="pool full"):
        pool.alloc(1, timeout=timeout)
    assert pool.stats()["allocations"] == 1  # nothing half-allocated


def test_a_request_that_can_never_fit_fails_at_once_even_without_timeout():
    pool = Pool(4 * A, alignment=A)
    with pytest.raises(PoolFullError, match="never fit"):
        pool.alloc(4 * A + 1)  # timeout=None would otherwise wait forever
    with pytest.raises(PoolFullError, match="never fit"):
        pool.try_alloc(5 * A)
    assert pool.stats()["used_bytes"] == 0


def test_stats_count_rounded_bytes_and_allocations():
    pool = Pool(16 * A, alignment=A)
    assert pool.stats() == {"capacity_bytes": 16 * A, "used_bytes": 0, "free_bytes": 16 * A, "allocations": 0}
    s1 = pool.alloc(100)
    pool.alloc(A + 1)
    assert pool.stats() == {"capacity_bytes": 16 * A, "used_bytes": 3 * A, "free_bytes": 13 * A, "allocations": 2}
    pool.free(s1)
    assert pool.stats()["used_bytes"] == 2 * A and pool.stats()["allocations"] == 1


def test_view_shares_memory_with_the_pool_buffer():
    pool = Pool(4 * A, alignment=A)
    pool.alloc(1)
    slot = pool.alloc(10)
    v = pool.view(slot)
    assert v.dtype == torch.uint8 and v.numel() == 10
    assert v.data_ptr() == pool.buffer.data_ptr() + slot.offset
    v.fill_(7)
    assert torch.all(pool.buffer[slot.offset : slot.offset + 10] == 7)
    pool.buffer[slot.offset] = 42
    assert v[0].item() == 42


def test_concurrent_alloc_and_free_leave_the_pool_empty():
    pool = Pool(8 * A, alignment=A)
    errors = []

    def worker(seed):
        rng = random.Random(seed)
        try:
            for _ in range(300):
                s = pool.alloc(rng.randint(1, 2 * A), timeout=30)
                pool.view(s).fill_(seed)
                assert torch.all(pool.view(s) == seed)  # nobody else wrote into our slot
                pool.free(s)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert pool.stats()["used_bytes"] == 0 and pool.stats()["allocations"] == 0


def live_ranges(live):
    return sorted((s.offset, s.offset + rounded(s.nbytes)) for s in live)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_random_allocs_and_frees_never_overlap_and_keep_exact_bookkeeping(seed):
    rng = random.Random(seed)
    capacity = 64 * A
    pool = Pool(capacity, alignment=A)
    live = []
    for _ in range(2000):
        if live and rng.random() < 0.45:
            pool.free(live.pop(rng.randrange(len(live))))
        else:
            n = rng.randint(0, 6 * A)
            slot = pool.try_alloc(n)
            if slot is None:  # first fit: None only when no hole is big enough
                edges = [0, *itertools.chain.from_iterable(live_ranges(live)), capacity]
                assert all(end - start < rounded(n) for start, end in zip(edges[::2], edges[1::2]))
                continue
            assert slot.nbytes == n and slot.offset % A == 0
            live.append(slot)
        ranges = live_ranges(live)
        assert all(end <= nxt for (_, end), (nxt, _) in itertools.pairwise(ranges)), "live slots overlap"
        assert all(0 <= start and end <= capacity for start, end in ranges)
        stats = pool.stats()
        assert stats["used_bytes"] == sum(end - start for start, end in ranges)
        assert stats["free_bytes"] == capacity - stats["used_bytes"]
        assert stats["allocations"] == len(live)
    for s in live:
        pool.free(s)
    assert pool.try_alloc(capacity) is not None
