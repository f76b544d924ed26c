"""KV events in vLLM's format: what this replica's prefix cache holds, for KV-aware routers.

`jkv serve --kv-events-endpoint tcp://127.0.0.1:5557` publishes every change to the engine's
prefix cache (`PagePool(events=...)`) as vLLM does (vllm/distributed/kv_events.py), so an
indexer that consumes vLLM's events (llm-d's KV-cache manager, Dynamo's ZMQ relay) can index
jkv replicas too:

- ZeroMQ PUB on the endpoint (bound here: indexers connect), multipart frames
  `[topic, seq, payload]`, `seq` an 8-byte big-endian counter from 0, one per batch;
- `payload` is msgpack of vLLM's msgspec structs (array_like, tagged):
  `[ts, [event, ...], data_parallel_rank]` with the events
  `["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium]`,
  `["BlockRemoved", block_hashes, medium]` and `["AllBlocksCleared"]`;
- replay (`--kv-events-replay-endpoint`): a ROUTER socket; a client that saw a gap in `seq`
  sends the first sequence number it wants (8 bytes big-endian) and receives `[seq, payload]`
  for each batch still buffered (the last `buffer_steps`), then `[-1, b""]`.

Block hashes are jkv's own (`page_pool.block_hashes`: 16-byte BLAKE2b chained over the
block's token ids; the first block also hashes the weights fingerprint, kv dtype, key layout
and tenant, so tenants never share an entry). An indexer that keys on the events' hashes and
parents works as with vLLM; one that recomputes vLLM's hashes from token ids would not match
them. A batch goes out every `interval` seconds (10 ms) with what changed meanwhile;
consecutive stored blocks of one prompt travel as one BlockStored, as vLLM sends them.

The engine calls the hooks inline (a deque append); this thread does the encoding and the
sending, so a slow or absent subscriber never slows a step (PUB drops past its high-water
mark, as in vLLM; replay recovers what was dropped while it is buffered).
"""

from __future__ import annotations

import collections
import logging
import threading
import time

import msgpack

log = logging.getLogger("jkv.serve")
END_SEQ = (-1).to_bytes(8, "big", signed=True)


def check_endpoint(name: str, endpoint: object) -> str:
    """A ZeroMQ endpoint to bind: `tcp://HOST:PORT` (`*` for every interface), `ipc://PATH`
    or `inproc://NAME`.

    Raises:
        ValueError: naming the flag and the value.
    """
    if not isinstance(endpoint, str):
        raise ValueError(f"{name}={endpoint!r} must be a str such as tcp://127.0.0.1:5557")
    scheme, sep, rest = endpoint.partition("://")
    if scheme == "tcp" and sep:
        host, colon, port = rest.rpartition(":")
        if colon and host and port.isdigit() and 0 < int(port) < 65536:
            return endpoint
    elif scheme in ("ipc", "inproc") and sep and rest:
        return endpoint
    raise ValueError(
        f"{name}={endpoint!r} is not a ZeroMQ endpoint to bind: tcp://HOST:PORT "
        "(e.g. tcp://127.0.0.1:5557 or tcp://*:5557), ipc://PATH or inproc://NAME"
    )


class KVEventPublisher:
    """Publishes the prefix cache's changes; pass it as `jkv.Engine(kv_events=publisher)`.

    Args:
        endpoint: where the PUB socket binds.
        replay_endpoint: where the replay ROUTER binds; None: no replay.
        topic: the first frame of every message (vLLM's default: empty).
        rank: `data_parallel_rank` in every batch (a replica's index).
        medium: where the blocks live ("GPU", "CPU"), in every event.
        buffer_steps: batches kept for replay.
        hwm: the PUB socket's high-water mark (messages queued per subscriber).
        interval: seconds between batches.

    Raises:
        ValueError: an endpoint that is malformed or cannot be bound (in use), named.
        ImportError: pyzmq is not installed (the serve extra has it).
    """

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None = None,
        *,
        topic: str = "",
        rank: int = 0,
        medium: str = "GPU",
        buffer_steps: int = 10_000,
        hwm: int = 100_000,
        interval: float = 0.01,
    ) -> None:
        import zmq

        check_endpoint("kv_events_endpoint", endpoint)
        if replay_endpoint is not None:
            check_endpoint("kv_events_replay_endpoint", replay_endpoint)
        self.endpoint, self.replay_endpoint = endpoint, replay_endpoint
        self._topic, self._rank, self._medium = topic.encode(), rank, medium
        self._interval = interval
        self._ctx = zmq.Context.instance()
        self._pub = self._bind(zmq.PUB, endpoint, "kv_events_endpoint", hwm)
        self._replay = None
        if replay_endpoint is not None:
            try:
                self._replay = self._bind(zmq.ROUTER, replay_endpoint, "kv_events_replay_endpoint")
            except ValueError:
                self._pub.close(linger=0)
                raise
        self._pending: collections.deque = collections.deque()
        self._buffer: collections.deque = collections.deque(maxlen=buffer_steps)
        self.seq = 0  # the next batch's sequence number
        self.sent_events = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="jkv-kv-events", daemon=True)
        self._thread.start()

    def _bind(self, kind: int, endpoint: str, name: str, hwm: int | None = None):
        import zmq

        sock = self._ctx.socket(kind)
        if hwm is not None:
            sock.set_hwm(hwm)
        try:
            sock.bind(endpoint)
        except zmq.ZMQError as e:
            sock.close(linger=0)
            raise ValueError(f"{name}={endpoint!r} cannot be bound: {e}") from None
        return sock

    # -- the pool's hooks (the engine's thread: appends only) ------------------------------

    def stored(self, block_hash: bytes, parent: bytes | None, tokens: list, block_size: int):
        self._pending.append(("s", block_hash, parent, tokens, block_size))

    def removed(self, block_hash: bytes) -> None:
        self._pending.append(("r", block_hash))

    def cleared(self) -> None:
        self._pending.append(("c",))

    # -- the publishing thread ---------------------------------------------------------------

    def _events(self) -> list:
        """Pending changes as vLLM events; consecutive stored blocks of a chain as one."""
        events: list = []
        while self._pending:
            item = self._pending.popleft()
            last = events[-1] if events else None
            if item[0] == "s":
                _, h, parent, tokens, size = item
                if last and last[0] == "BlockStored" and last[1][-1] == parent and last[4] == size:
                    last[1].append(h)
                    last[3].extend(tokens)
                else:
                    events.append(
                        ["BlockStored", [h], parent, list(tokens), size, None, self._medium]
                    )
            elif item[0] == "r":
                if last and last[0] == "BlockRemoved":
                    last[1].append(item[1])
                else:
                    events.append(["BlockRemoved", [item[1]], self._medium])
            else:
                events.append(["AllBlocksCleared"])
        return events

    def _flush(self) -> None:
        events = self._events()
        if not events:
            return
        payload = msgpack.packb([time.time(), events, self._rank], use_bin_type=True)
        seq = self.seq.to_bytes(8, "big")
        self._pub.send_multipart((self._topic, seq, payload))
        self._buffer.append((self.seq, payload))
        self.seq += 1
        self.sent_events += len(events)

    def _serve_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            log.warning("kv events: ignored a malformed replay request (%d frames)", len(frames))
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= first:
                self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", END_SEQ, b""))

    def _run(self) -> None:
        import zmq

        poller = zmq.Poller()
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        while not self._stop.is_set():
            try:
                ready = dict(poller.poll(self._interval * 1000)) if self._replay else {}
                if not self._replay:
                    self._stop.wait(self._interval)
                if self._replay is not None and ready.get(self._replay):
                    self._serve_replay()
                self._flush()
            except Exception as e:  # a bad request or a send error must not end the events
                log.warning("kv events: %s: %s", type(e).__name__, e)
                self._stop.wait(0.1)
        try:
            self._flush()  # what changed before the stop
        except Exception as e:  # noqa: BLE001 - closing anyway
            log.warning("kv events: last batch not sent: %s", e)

    def close(self) -> None:
        """Sends what is pending, stops the thread, closes the sockets. Idempotent."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join(5)
        self._pub.close(linger=100)
        if self._replay is not None:
            self._replay.close(linger=0)
