"""/dev/shm segments, the shm-backed pool, orphan cleanup and the SHM transport."""

import os
import secrets
import stat

import pytest
import torch

from ectransfer import shm, tensors
from ectransfer.protocol import ProtocolError
from epd.transfer.v1 import transfer_pb2
from tests.unit.helpers import assert_bit_identical, dead_pid, descriptor, random_bits, rebuild, special_values

pytestmark = [pytest.mark.unit, pytest.mark.skipif(not os.path.isdir(shm.SHM_DIR), reason="no /dev/shm")]


def path(name: str) -> str:
    return os.path.join(shm.SHM_DIR, name)


@pytest.fixture
def names():
    """Fresh segment names owned by this process; whatever is left is unlinked."""
    made = []

    def new(pid: int = os.getpid()) -> str:
        made.append(f"epd-test-{pid}-{secrets.token_hex(4)}")
        return made[-1]

    yield new
    for n in made:
        if os.path.exists(path(n)):
            os.unlink(path(n))


@pytest.fixture
def pool():
    p = shm.ShmPool(1 << 20, "test")
    yield p
    p.close()


def test_create_makes_a_0600_file_of_the_requested_size(names):
    name = names()
    seg = shm.ShmSegment.create(name, 4096)
    st = os.stat(path(name))
    assert stat.S_IMODE(st.st_mode) == 0o600
    assert st.st_size == 4096 and seg.buffer.numel() == 4096 and seg.owner
    with pytest.raises(FileExistsError):
        shm.ShmSegment.create(name, 4096)  # O_EXCL: never adopts someone else's segment
    seg.close()
    assert not os.path.exists(path(name))


@pytest.mark.parametrize("bad", ["a/b", "..", ".", "", "has space", "x" * 201, "../etc/passwd", "a\0b", "é"])
def test_validate_name_rejects(bad):
    with pytest.raises(ValueError, match="invalid shared-memory name"):
        shm.validate_name(bad)


@pytest.mark.parametrize("good", ["epd-lm-12-ab", "A_b.c-9", "x" * 200, "..."])
def test_validate_name_accepts(good):
    assert shm.validate_name(good) == good


def test_new_name_carries_role_and_pid_and_is_matched_by_cleanup():
    n = shm.new_name("encoder")
    assert n.startswith(f"epd-encoder-{os.getpid()}-")
    assert shm._OWNED.match(n).group(1) == str(os.getpid())


def test_attach_sees_the_owners_writes_and_vice_versa(names):
    name = names()
    owner = shm.ShmSegment.create(name, 1024)
    reader = shm.ShmSegment.attach(name)
    writer = shm.ShmSegment.attach(name, readonly=False)
    assert (reader.nbytes, reader.owner) == (1024, False)
    owner.buffer[10:20] = 5
    assert torch.all(reader.buffer[10:20] == 5)
    writer.buffer[0] = 99
    assert owner.buffer[0].item() == 99
    reader.close()
    writer.close()
    assert os.path.exists(path(name))  # only the owner unlinks
    owner.close()
    assert not os.path.exists(path(name))


def test_attach_to_a_missing_segment_raises(names):
    with pytest.raises(FileNotFoundError):
        shm.ShmSegment.attach(names())


def test_pool_close_unlinks_its_segment():
    p = shm.ShmPool(64 << 10, "test")
    name = p.name
    assert os.path.exists(path(name)) and name.startswith(f"epd-test-{os.getpid()}-")
    slot = p.alloc(100)
    p.view(slot).fill_(1)
    p.close()
    assert not os.path.exists(path(name))


def test_cleanup_orphans_removes_dead_owners_and_keeps_live_ones(names):
    dead = names(dead_pid())  # a file nobody holds: its owner died
    with open(path(dead), "wb") as f:
        f.write(b"\0" * 16)
    live = shm.ShmSegment.create(names(dead_pid()), 16)  # held by us, whatever pid its name claims
    unrelated = f"not-epd-{dead_pid()}"  # a name we do not own the pattern of
    open(path(unrelated), "wb").close()
    try:
        removed = shm.cleanup_orphans()
        # ``dead`` is gone: removed by this sweep, or by another process's sweep
        # that ran at the same moment (benchmarks and tests stop deployments too).
        assert live.name not in removed and unrelated not in removed
        assert not os.path.exists(path(dead))
        assert os.path.exists(path(live.name)) and os.path.exists(path(unrelated))
    finally:
        live.close()
        os.unlink(path(unrelated))


def test_a_segment_is_an_orphan_once_its_owner_process_is_killed(names):
    import subprocess
    import sys

    name = names()
    code = f"from ectransfer.shm import ShmSegment; s = ShmSegment.create({name!r}, 4096); print('up', flush=True); input()"
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert proc.stdout.readline().strip() == "up"
    assert name not in shm.cleanup_orphans()  # alive: kept
    proc.kill()
    proc.wait()
    assert name in shm.cleanup_orphans()  # kill -9 released its lock


def test_a_zero_byte_segment_is_created_or_leaves_nothing_behind(names):
    name = names()
    try:
        shm.ShmSegment.create(name, 0).close()
    except (OSError, ValueError):
        pass
    assert not os.path.exists(path(name))


# --- the SHM transport -----------------------------------------------------------------------------------------


def put_in_pool(pool, t):
    data = tensors.as_bytes(t)
    slot = pool.alloc(data.numel())
    pool.view(slot).copy_(data)
    return slot


@pytest.mark.parametrize(
    "make",
    [
        lambda d: random_bits((16, 128), d, seed=1),
        lambda d: random_bits((1, 1), d, seed=2),
        lambda d: random_bits((0, 128), d),
        lambda d: random_bits((64, 32), d, seed=3).t(),
        lambda d: special_values(d),
    ],
    ids=["16x128", "1x1", "empty", "transposed", "special"],
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_producer_and_consumer_round_trip_bit_identical(pool, dtype, make):
    pool.alloc(3)  # so the item does not sit at offset 0
    t = make(dtype)
    slot = put_in_pool(pool, t)
    desc = descriptor(t)
    shm.ShmProducer(pool).describe(pool.view(slot), desc)
    assert desc.WhichOneof("payload") == "shm"
    assert desc.shm.segment == pool.name and desc.shm.segment_nbytes == pool.capacity
    if t.numel():
        assert desc.shm.offset == slot.offset
    consumer = shm.ShmConsumer()
    try:
        dest = torch.empty(desc.nbytes, dtype=torch.uint8)
        receiver = consumer.receiver(desc, dest)
        assert receiver.complete  # shm bytes are there at once
        assert_bit_identical(rebuild(dest, desc), t)
        pool.view(slot).zero_()  # the consumer copied: later writes do not reach it
        assert_bit_identical(rebuild(dest, desc), t)
    finally:
        consumer.close()


def test_consumer_maps_each_segment_once(pool):
    slot = put_in_pool(pool, torch.arange(10, dtype=torch.float32))
    desc = descriptor(torch.arange(10, dtype=torch.float32))
    shm.ShmProducer(pool).describe(pool.view(slot), desc)
    consumer = shm.ShmConsumer()
    try:
        consumer.receiver(desc, torch.empty(40, dtype=torch.uint8))
        first = consumer.mappings.get(pool.name)
        consumer.receiver(desc, torch.empty(40, dtype=torch.uint8))
        assert consumer.mappings.get(pool.name) is first
    finally:
        consumer.close()


def _shm_desc(pool, offset, nbytes):
    desc = descriptor(torch.empty(nbytes, dtype=torch.uint8))
    desc.shm.segment, desc.shm.offset, desc.shm.segment_nbytes = pool.name, offset, pool.capacity
    return desc


@pytest.mark.parametrize("offset, nbytes", [(0, (1 << 20) + 1), ((1 << 20) - 10, 11), (1 << 21, 1)])
def test_a_range_outside_the_segment_raises(pool, offset, nbytes):
    consumer = shm.ShmConsumer()
    try:
        with pytest.raises(ProtocolError, match="outside"):
            consumer.receiver(_shm_desc(pool, offset, nbytes), torch.empty(nbytes, dtype=torch.uint8))
    finally:
        consumer.close()


@pytest.mark.parametrize("segment", ["missing", "../etc/passwd"])
def test_a_missing_or_invalid_segment_raises(names, segment):
    desc = descriptor(torch.empty(4, dtype=torch.uint8))
    desc.shm.segment = names() if segment == "missing" else segment
    with pytest.raises(ProtocolError, match="cannot map shared-memory segment|not an epd segment"):
        shm.ShmConsumer().receiver(desc, torch.empty(4, dtype=torch.uint8))


def test_wrong_payload_kind_and_chunks_are_rejected(pool):
    desc = descriptor(torch.empty(4, dtype=torch.uint8))
    desc.chunks.num_chunks = 1
    with pytest.raises(ProtocolError, match="shared-memory payload"):
        shm.ShmConsumer().receiver(desc, torch.empty(4, dtype=torch.uint8))
    consumer = shm.ShmConsumer()
    try:
        receiver = consumer.receiver(_shm_desc(pool, 0, 4), torch.empty(4, dtype=torch.uint8))
        with pytest.raises(ProtocolError, match="no chunks"):
            receiver.feed(transfer_pb2.Chunk(identifier="x", offset=0, data=b"1234"))
    finally:
        consumer.close()


@pytest.mark.parametrize("kind", ["fifo", "symlink"])
def test_cleanup_orphans_leaves_a_fifo_or_a_link_at_an_epd_name_alone_without_hanging(names, kind, tmp_path):
    import threading

    name = names(dead_pid())  # a name whose owner looks dead: cleanup would open it
    if kind == "fifo":
        os.mkfifo(path(name), 0o600)
    else:
        target = tmp_path / "target"
        target.write_bytes(b"\0" * 16)
        os.symlink(target, path(name))
    done = threading.Event()
    removed: list[str] = []
    threading.Thread(target=lambda: (removed.extend(shm.cleanup_orphans()), done.set()), daemon=True).start()
    try:
        assert done.wait(10), "cleanup_orphans blocked opening the FIFO"
        assert name not in removed and os.path.lexists(path(name))  # not a segment: not ours to judge
    finally:
        if kind == "fifo":  # release an open that still waits for a writer (the old behaviour)
            try:
                os.close(os.open(path(name), os.O_WRONLY | os.O_NONBLOCK))
            except OSError:
                pass
        os.unlink(path(name))


# --- cleanup_orphans next to foreign entries it cannot judge or remove ------------------------------------------


def make_orphan(name: str) -> str:
    """A 16-byte file at ``name`` that nobody holds: cleanup_orphans removes it."""
    with open(path(name), "wb") as f:
        f.write(b"\0" * 16)
    return name


def test_cleanup_orphans_skips_a_directory_at_an_epd_name_and_cleans_the_rest(names, caplog):
    folder = names(dead_pid())
    os.mkdir(path(folder), 0o700)
    orphan = make_orphan(names(dead_pid()))
    try:
        with caplog.at_level("WARNING", logger="ectransfer.shm"):
            removed = shm.cleanup_orphans()
        assert folder not in removed and os.path.isdir(path(folder))
        assert not os.path.exists(path(orphan))
        assert any(folder in r.getMessage() for r in caplog.records)
    finally:
        os.rmdir(path(folder))


def test_cleanup_orphans_skips_a_segment_it_may_not_unlink_and_cleans_the_rest(names, monkeypatch, caplog):
    denied, orphan = make_orphan(names(dead_pid())), make_orphan(names(dead_pid()))
    real_unlink = os.unlink

    def unlink(p, *args, **kwargs):
        if os.path.basename(p) == denied:
            raise PermissionError(1, "Operation not permitted", p)  # another user's file in sticky /dev/shm
        return real_unlink(p, *args, **kwargs)

    monkeypatch.setattr(os, "unlink", unlink)
    with caplog.at_level("WARNING", logger="ectransfer.shm"):
        removed = shm.cleanup_orphans()
    monkeypatch.undo()
    assert denied not in removed and os.path.exists(path(denied))
    assert not os.path.exists(path(orphan))
    warned = [r.getMessage() for r in caplog.records if denied in r.getMessage()]
    assert warned and "not permitted" in warned[0]


def test_cleanup_orphans_skips_a_segment_it_cannot_lock_and_cleans_the_rest(names, monkeypatch, caplog):
    import errno
    import fcntl

    unlockable, orphan = make_orphan(names(dead_pid())), make_orphan(names(dead_pid()))
    real_flock = fcntl.flock

    def flock(fd, op):
        if os.path.basename(os.readlink(f"/proc/self/fd/{fd}")) == unlockable:
            raise OSError(errno.ENOLCK, "No locks available")
        return real_flock(fd, op)

    monkeypatch.setattr(fcntl, "flock", flock)
    with caplog.at_level("WARNING", logger="ectransfer.shm"):
        removed = shm.cleanup_orphans()
    monkeypatch.undo()
    assert unlockable not in removed and os.path.exists(path(unlockable))
    assert not os.path.exists(path(orphan))
    assert any(unlockable in r.getMessage() for r in caplog.records)


def test_cleanup_orphans_that_cannot_list_dev_shm_warns_and_removes_nothing(monkeypatch, caplog):
    def listdir(p):
        raise PermissionError(13, "Permission denied", p)

    monkeypatch.setattr(os, "listdir", listdir)
    with caplog.at_level("WARNING", logger="ectransfer.shm"):
        assert shm.cleanup_orphans() == []
    assert any(shm.SHM_DIR in r.getMessage() for r in caplog.records)


def test_attach_refuses_a_fifo_or_a_link(names, tmp_path):
    import threading

    fifo, link = names(), names()
    os.mkfifo(path(fifo), 0o600)
    os.symlink(tmp_path, path(link))
    errors: list[BaseException | None] = []

    def attach_each() -> None:
        for name in (fifo, link):
            try:
                shm.ShmSegment.attach(name).close()
                errors.append(None)
            except OSError as e:
                errors.append(e)

    try:
        t = threading.Thread(target=attach_each, daemon=True)
        t.start()
        t.join(10)
        assert len(errors) == 2 and all(isinstance(e, OSError) for e in errors), errors
    finally:
        try:  # release an open that still waits for a writer (the old behaviour)
            os.close(os.open(path(fifo), os.O_WRONLY | os.O_NONBLOCK))
        except OSError:
            pass
        os.unlink(path(fifo))
        os.unlink(path(link))


@pytest.mark.parametrize("bad", ["psm_1a2b", "epd-staging-12-ab", "epd-outbound-12-ab/..", "epd-outbound-12-ab\n",
                                 "epd-outbound-x-ab", "../epd-outbound-12-ab", ""])
def test_a_peer_segment_must_be_a_producers_epd_segment(bad):
    with pytest.raises(ProtocolError):
        shm.validate_peer_segment(bad)
    assert shm.validate_peer_segment("epd-outbound-12-ab") == "epd-outbound-12-ab"


@pytest.mark.parametrize("offset, nbytes, ok", [
    (0, 16, True), (4080, 16, True), (4081, 16, False), (4096, 0, True), (4097, 0, False),
    (2**64 - 1, 16, False), (2**63, 2**63, False), (-1, 16, False), (0, -1, False),
])
def test_check_range_is_exact_at_the_end_and_never_wraps(offset, nbytes, ok):
    from ectransfer.pool import check_range

    if ok:
        check_range(offset, nbytes, 4096, "seg")
    else:
        with pytest.raises(ProtocolError, match="outside"):
            check_range(offset, nbytes, 4096, "seg")
