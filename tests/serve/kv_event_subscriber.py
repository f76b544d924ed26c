"""A KV-event subscriber as an indexer writes one against vLLM: the message types declared with
msgspec exactly as vLLM declares them (array_like, tagged structs; vllm/distributed/
kv_events.py), a SUB socket, gap detection on the sequence number and catch-up through the
replay socket. It rebuilds the set of block hashes a replica holds."""

from __future__ import annotations

import threading
import time

import msgspec


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Base of vLLM's KV-cache events."""


class BlockStored(KVCacheEvent):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[bytes | int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


DECODER = msgspec.msgpack.Decoder(KVEventBatch)


class Subscriber:
    """Follows one replica's events in a thread: `blocks` is the set of hashes it holds,
    `tokens[h]` a block's token ids, `last_seq` the last batch applied, `replays` how many
    times a gap was filled from the replay socket."""

    def __init__(self, endpoint: str, replay_endpoint: str | None = None, topic: bytes = b""):
        import zmq

        self.endpoint, self.replay_endpoint, self.topic = endpoint, replay_endpoint, topic
        self.blocks: set = set()
        self.tokens: dict = {}
        self.parents: dict = {}
        self.last_seq = -1
        self.replays = 0
        self.batches = 0
        self.errors: list[str] = []
        self._ctx = zmq.Context.instance()
        self._stop = threading.Event()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, topic)
        self._sub.connect(endpoint)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def apply(self, seq: int, payload: bytes) -> None:
        if seq <= self.last_seq:
            return  # already applied (a replay overlapping the live stream)
        batch = DECODER.decode(payload)
        for event in batch.events:
            if isinstance(event, BlockStored):
                size = event.block_size
                parent = event.parent_block_hash
                for i, h in enumerate(event.block_hashes):
                    self.blocks.add(h)
                    self.tokens[h] = event.token_ids[i * size : (i + 1) * size]
                    self.parents[h] = parent
                    parent = h
            elif isinstance(event, BlockRemoved):
                for h in event.block_hashes:
                    self.blocks.discard(h)
            else:
                self.blocks.clear()
        self.last_seq = seq
        self.batches += 1

    def replay(self, first: int) -> None:
        """Asks the replay socket for every batch from `first` on, and applies them. A DEALER
        that sends REQ's empty delimiter frame: it may receive the many replies ROUTER sends
        to one request (a REQ socket takes one)."""
        import zmq

        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.RCVTIMEO, 5000)
        dealer.connect(self.replay_endpoint)
        try:
            dealer.send_multipart((b"", first.to_bytes(8, "big")))
            while True:
                _, seq_bytes, payload = dealer.recv_multipart()
                seq = int.from_bytes(seq_bytes, "big", signed=True)
                if seq < 0:
                    break
                self.apply(seq, payload)
        finally:
            dealer.close(linger=0)
        self.replays += 1

    def _run(self) -> None:
        import zmq

        poller = zmq.Poller()
        poller.register(self._sub, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(50):
                continue
            topic, seq_bytes, payload = self._sub.recv_multipart()
            seq = int.from_bytes(seq_bytes, "big")
            try:
                if seq > self.last_seq + 1 and self.replay_endpoint:
                    self.replay(self.last_seq + 1)
                self.apply(seq, payload)
            except Exception as e:  # reported by the test
                self.errors.append(repr(e))

    def wait_for(self, seq: int, within: float = 10.0) -> bool:
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            if self.last_seq >= seq:
                return True
            time.sleep(0.01)
        return self.last_seq >= seq

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._sub.close(linger=0)
