"""What an LM's prefix cache holds, by media item and by prefix key, from vLLM's KV cache events.

vLLM publishes every block its prefix cache stores or drops (``BlockStored``/``BlockRemoved``/
``AllBlocksCleared``, ``vllm.distributed.kv_events``) on a ZMQ socket when ``kv_events_config`` enables
them. A stored block's ``extra_keys`` name the media items (``(mm_identifier, offset)``) whose embeddings
its tokens include; epd-serve's identifiers are content hashes (``MMItem.identifier``), the ones the
gateway routes by. A stored block's ``session_id`` is the request's: the LM sets it to the gateway's prefix
key (``services.fleet_memory.prefix``; a client's own ``session_id`` never reaches vLLM), so a key names the
blocks of the prompt it keys. ``Holdings`` keeps, per item or key, how many of its blocks the cache holds;
it is held while that count is above zero.

Owner: the LM service makes one ``Holdings`` and one ``EventListener`` (its thread reads the engine's
socket, a private ``ipc://`` path in the LM's own directory, never a network port), and stops the listener
before the engine. ``LMService.Holdings`` reads ``snapshot()``.

Bounded: at most ``max_blocks`` blocks with items and ``max_items`` items (the least recently stored go
first; dropping one costs the gateway a miss). A gap in the publisher's sequence numbers (events the socket
dropped) clears everything and starts a new epoch: the gateway then takes the next snapshot whole."""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import tempfile
import threading
from collections import OrderedDict
from typing import Any

from services.fleet_memory.prefix import KEY_PREFIX

logger = logging.getLogger(__name__)

MAX_ITEMS = 4096
MAX_BLOCKS = 1 << 16


def _items_of(keys: tuple[Any, ...] | None, session: Any = None) -> tuple[str, ...]:
    """The media identifiers in one block's published extra keys (``(mm_identifier, offset)`` pairs; LoRA
    names, cache salts and prompt-embedding digests are bare values), and its request's prefix key."""
    items = () if not keys else tuple(
        k[0] for k in keys if isinstance(k, (tuple, list)) and len(k) == 2 and isinstance(k[0], str))
    if isinstance(session, str) and session.startswith(KEY_PREFIX) and len(session) <= 64:
        items += (session,)
    return items


class Holdings:
    """Per media item, the number of its blocks in this LM's prefix cache. Thread-safe: the listener's
    thread applies events, gRPC handlers take snapshots."""

    def __init__(self, max_items: int = MAX_ITEMS, max_blocks: int = MAX_BLOCKS) -> None:
        self.max_items, self.max_blocks = max_items, max_blocks
        self.epoch = secrets.token_hex(8)
        """Changes when this process starts and whenever the holdings were cleared for a gap: a snapshot of
        another epoch replaces the directory's entry whole."""
        self.generation = 0
        """Counts changes within the epoch (an unchanged generation: no snapshot to send)."""
        self._blocks: OrderedDict[Any, tuple[str, ...]] = OrderedDict()
        self._items: OrderedDict[str, int] = OrderedDict()
        self._lock = threading.Lock()

    def stored(self, block_hashes: list[Any], extra_keys: list[tuple[Any, ...] | None] | None,
               session: Any = None) -> None:
        with self._lock:
            for i, block in enumerate(block_hashes):
                items = _items_of(extra_keys[i] if extra_keys and i < len(extra_keys) else None, session)
                if not items or block in self._blocks:
                    continue
                self._blocks[block] = items
                for item in items:
                    self._items[item] = self._items.get(item, 0) + 1
                    self._items.move_to_end(item)
                self.generation += 1
            while len(self._blocks) > self.max_blocks:
                self._drop_block(next(iter(self._blocks)))
            while len(self._items) > self.max_items:
                item, _ = self._items.popitem(last=False)  # its blocks stay counted nowhere: a miss at worst
                self.generation += 1

    def removed(self, block_hashes: list[Any]) -> None:
        with self._lock:
            for block in block_hashes:
                if block in self._blocks:
                    self._drop_block(block)

    def _drop_block(self, block: Any) -> None:
        for item in self._blocks.pop(block):
            n = self._items.get(item)
            if n is None:
                continue
            if n <= 1:
                del self._items[item]
            else:
                self._items[item] = n - 1
        self.generation += 1

    def cleared(self, new_epoch: bool = False) -> None:
        """Everything dropped (``AllBlocksCleared``, or ``new_epoch`` after lost events)."""
        with self._lock:
            self._blocks.clear()
            self._items.clear()
            self.generation += 1
            if new_epoch:
                self.epoch = secrets.token_hex(8)
                self.generation = 0

    def apply(self, event: Any) -> None:
        """One of vLLM's KV cache events (by its class name: the LM service imports vLLM, this module need not)."""
        kind = type(event).__name__
        if kind == "BlockStored":
            self.stored(list(event.block_hashes), event.extra_keys, getattr(event, "session_id", None))
        elif kind == "BlockRemoved":
            self.removed(list(event.block_hashes))
        elif kind == "AllBlocksCleared":
            self.cleared()

    def snapshot(self) -> tuple[str, int, list[str]]:
        """``(epoch, generation, items)``: the items and prefix keys held now, most recently stored last."""
        with self._lock:
            return self.epoch, self.generation, list(self._items)

    def __contains__(self, item: str) -> bool:
        with self._lock:
            return item in self._items


def events_endpoint(run_dir: str) -> str:
    """The private socket the LM's engine publishes its KV events on (a path in the LM's own directory,
    mode 0700: no other user, and no network peer, can subscribe)."""
    return f"ipc://{os.path.join(run_dir, 'kv-events')}"


def kv_events_config(endpoint: str):
    """vLLM's ``KVEventsConfig`` that publishes this LM's KV cache events on ``endpoint`` (no replay
    socket; a bounded queue: past it vLLM drops events, which the listener sees as a gap)."""
    from vllm.config.kv_events import KVEventsConfig

    return KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=endpoint, hwm=10_000,
                          max_queue_size=10_000)


class EventListener:
    """Reads the engine's KV event socket on one thread and applies each batch to ``holdings``."""

    def __init__(self, endpoint: str, holdings: Holdings) -> None:
        self.endpoint, self.holdings = endpoint, holdings
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="epd-kv-events", daemon=True)
        self._next_seq: int | None = None
        self.batches = 0

    def start(self) -> EventListener:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def handle(self, seq: int, events: list[Any]) -> None:
        """One batch, numbered ``seq`` by the publisher: a gap means lost events (start a new epoch)."""
        if self._next_seq is not None and seq != self._next_seq:
            logger.info("kv events %d..%d lost: the holdings start again", self._next_seq, seq - 1)
            self.holdings.cleared(new_epoch=True)
        self._next_seq = seq + 1
        for event in events:
            self.holdings.apply(event)
        self.batches += 1

    def _run(self) -> None:
        import msgspec
        import zmq
        from vllm.distributed.kv_events import KVEventBatch

        decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        ctx = zmq.Context.instance()
        sock = ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        sock.setsockopt(zmq.RCVHWM, 10_000)
        sock.connect(self.endpoint)
        try:
            while not self._stop.is_set():
                if not sock.poll(200):
                    continue
                try:
                    _topic, seq, payload = sock.recv_multipart()
                    self.handle(int.from_bytes(seq, "big"), decoder.decode(payload).events)
                except Exception:  # a malformed batch: drop it and start over (never the listener)
                    logger.exception("a kv event batch could not be read")
                    self._next_seq = None
                    self.holdings.cleared(new_epoch=True)
        finally:
            sock.close(linger=0)


class Published:
    """An LM's holdings, published: a private directory for vLLM's socket (mode 0700, removed by
    ``close``), the engine argument that makes vLLM publish there, and the listener that reads it back.
    Owner: the LM's ``serve``: ``engine_args`` before the engine starts, ``start`` after, ``close`` last."""

    def __init__(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="epd-lm-events-")
        self.endpoint = events_endpoint(self.dir)
        self.holdings = Holdings()
        self.listener: EventListener | None = None

    def engine_args(self) -> dict[str, Any]:
        return {"kv_events_config": kv_events_config(self.endpoint)}

    def start(self) -> None:
        self.listener = EventListener(self.endpoint, self.holdings).start()

    def close(self) -> None:
        if self.listener is not None:
            self.listener.stop()
        shutil.rmtree(self.dir, ignore_errors=True)
