"""A NIXL producer and a NIXL consumer, each in its own process, driven line by line over stdin/stdout.

Fault tests need real agents in real processes (one to kill, each with UCX held to what the test
sets, e.g. ``UCX_TLS=tcp`` so a READ needs the producer's progress and can be caught in flight).

    python -m tests.integration.nixl_peers producer   # prints its endpoint, then answers commands
    python -m tests.integration.nixl_peers consumer

Producer commands: ``put <ident> <nbytes> <seed>`` (an item of random bytes from ``seed``),
``freeze`` / ``thaw`` (stop / restart the NIXL progress thread: a READ over TCP then waits),
``stats``. Consumer commands: ``fetch <endpoint> <ident> <nbytes>`` (returns at once), ``state
<ident>``, ``wait <ident>`` (until LANDED or FAILED), ``check <ident> <seed>`` (the landed bytes
are the producer's), ``free <ident>`` (the staging slot is freed and the item cancelled, as an
aborted request does), ``stats``. Every answer is one JSON line; NIXL's own log lines go to stderr.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch

from ectransfer.nixl import NixlProducer
from ectransfer.protocol import ItemTransfer, TransferState
from tests.support.loopback import Consumer, Producer

WAIT_S = 60.0
READ_TIMEOUT_S = 10.0  # a READ from a killed producer fails within this (if UCX does not notice first)


def item_bytes(nbytes: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)


def _answer(obj) -> None:
    sys.__stdout__.write(json.dumps(obj) + "\n")
    sys.__stdout__.flush()


def producer_stats(producer: Producer) -> dict:
    nixl = next(t for t in producer.servicer.transports.values() if isinstance(t, NixlProducer))
    sessions = list(producer.servicer.sessions)
    return {"sessions": len(sessions), "holds": sum(len(s.holds) for s in sessions),
            "items": producer.store.snapshot().get("items", 0), "outstanding": nixl.progress.outstanding,
            "completed": nixl.progress.completed}


def run_producer(transports: tuple[str, ...]) -> None:
    producer = Producer(pool_bytes=160 << 20, transports=transports, item_wait_s=30)
    nixl = next(t for t in producer.servicer.transports.values() if isinstance(t, NixlProducer))
    _answer({"endpoint": producer.endpoint})
    try:
        for line in sys.stdin:
            cmd, *args = line.split()
            if cmd == "put":
                ident, nbytes, seed = args[0], int(args[1]), int(args[2])
                _answer({"ok": producer.store.put(ident, item_bytes(nbytes, seed))})
            elif cmd == "freeze":
                nixl.progress.stop()
                _answer({"ok": True})
            elif cmd == "thaw":
                nixl.progress = type(nixl.progress)(nixl.agent)
                nixl.progress.start()
                _answer({"ok": True})
            elif cmd == "stats":
                _answer(producer_stats(producer))
            elif cmd == "quit":
                break
    finally:
        producer.close()


def run_consumer(transports: tuple[str, ...]) -> None:
    consumer = Consumer(transports=transports, staging_bytes=160 << 20, timeout_s=WAIT_S)
    nixl = consumer.client.transports[0]
    nixl.read_timeout_s = READ_TIMEOUT_S
    items: dict[str, tuple[ItemTransfer, object, object]] = {}
    _answer({"ready": True})
    try:
        for line in sys.stdin:
            cmd, *args = line.split()
            if cmd == "fetch":
                endpoint, ident, nbytes = args[0], args[1], int(args[2])
                items[ident] = consumer.start(endpoint, ident, nbytes)
                _answer({"ok": True})
            elif cmd == "state":
                transfer = items[args[0]][0]
                _answer({"state": transfer.state.name, "error": transfer.error})
            elif cmd == "wait":
                transfer = items[args[0]][0]
                transfer.wait_for({TransferState.LANDED, TransferState.FAILED}, WAIT_S)
                _answer({"state": transfer.state.name, "error": transfer.error,
                         "transport": consumer.client.transport_of(items[args[0]][1].endpoint)})
            elif cmd == "check":
                transfer, fetch, slot = items[args[0]]
                got = consumer.staging.view(slot)
                _answer({"exact": bool(torch.equal(got, item_bytes(got.numel(), int(args[1]))))})
            elif cmd == "free":
                transfer, fetch, slot = items.pop(args[0])
                consumer.staging.free(slot)
                transfer.try_advance(TransferState.CANCELLED)
                consumer.client.cancel(fetch.endpoint, args[0], fetch.claim, fetch.copy)
                _answer({"ok": True})
            elif cmd == "stats":
                time.sleep(0.2)  # the client thread handles what is queued (a closed stream, a cancel)
                _answer({"remote_agents": len(nixl.remote_agents), "regions": nixl.registered_regions,
                         "reads": nixl.reads, "staging_used": consumer.staging.stats()["used_bytes"]})
            elif cmd == "quit":
                break
    finally:
        consumer.close()
        nixl.close()


class Peer:
    """One peer process (the test's handle): ``ask`` sends a command and returns its JSON answer;
    ``kill`` ends it by SIGKILL; ``close`` asks it to quit (and kills it if it will not)."""

    def __init__(self, role: str, transports: str = "nixl", env: dict[str, str] | None = None) -> None:
        import subprocess

        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.integration.nixl_peers", role, transports],
                                     cwd=root, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     bufsize=1, env={**os.environ, **(env or {})})
        self.hello = self._read()

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the peer exited ({self.proc.wait(timeout=30)})")
        return json.loads(line)

    def ask(self, *words) -> dict:
        self.proc.stdin.write(" ".join(map(str, words)) + "\n")
        return self._read()

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=30)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write("quit\n")
                self.proc.stdin.close()
                self.proc.wait(timeout=30)
            except Exception:  # noqa: BLE001 - it would not quit
                self.kill()


def main() -> None:
    role = sys.argv[1]
    transports = tuple(sys.argv[2].split(",")) if len(sys.argv) > 2 else ("nixl",)
    sys.stdout = sys.stderr  # NIXL's INFO lines are printed; the answers are ours alone
    torch.set_num_threads(1)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    (run_producer if role == "producer" else run_consumer)(transports)


if __name__ == "__main__":
    main()
