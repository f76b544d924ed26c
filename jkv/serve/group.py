"""One engine over the devices of several processes (hosts): `jkv serve MODEL --coordinator
HOST:PORT --num-processes N --process-id I`, the same command on every host but for I.

JAX's multi-controller runtime (`jax.distributed`; on CPU, gloo collectives) makes the devices
of all N processes one mesh, and every process builds the same engine over it (`Engine(mesh=)`:
the pool sharded over kv heads), so each compiled step runs on all of them at once and every
process must run the same programs in the same order. Process 0, the leader, runs the HTTP
server, the scheduler and the engine's host side; the others, the followers, only run its
device work. At each engine step the leader sends them, over a TCP channel at HOST:PORT+1,
every device call of the step as it makes it (`jkv.engine.lockstep`: the function by name, its
host arguments such as page-table rows, token ids and sampling settings, its device arguments as
references to the weights, the pool or an earlier call's output), each read of a device value
back to the host (a sharded one is gathered by all processes), and at the step's end which
arrays are the pool now. A follower runs them in order on its shard and never schedules, so it
has no plan of its own that could differ (nano-vllm's and tpu-inference's way: one scheduler).
When the leader's engine starts serving it sends its shapes (weights, pool, kv dtype, page
size); a follower whose engine differs, or which cannot run one of the leader's calls, exits
with status 4, and the leader then sees it gone.

Failures, each within a bound: every process sends the others a heartbeat each second, from a
thread of its own, which stops beating when its process is stuck in a step: in one for
`--group-timeout` seconds without building a program (`StepWatch`: a compile is progress, one
finished or one under way in the stepping thread, so a cold step is not a hang however long
its compile; a step waiting in a collective for a hung process is). The leader counts a
follower as lost when its channel closes (a killed process, or a follower that exited: at once)
or it is silent for `--group-timeout` seconds (a frozen one); a follower stuck in a step exits
with status 3; a leader stuck in one counts itself lost. Then every request in flight ends with
a 503 `group_lost`, new ones and /health get 503, and the leader exits with status 3 after
`DRAIN_S` seconds, without waiting for a step stuck in a collective with the lost process. A
follower that loses the leader the same way exits with status 3. jax.distributed cannot take a
process back into a running group: restart the whole group (a supervisor restarting every
process on status 3 recovers it). On SIGTERM the leader shuts down gracefully, tells the followers to stop,
and all exit 0.

The channel carries pickles: it must join only the group's own processes (a private network,
as jax.distributed's coordinator port).
"""

from __future__ import annotations

import logging
import os
import pickle
import queue
import socket
import struct
import sys
import threading
import time

from jkv.compile_time import programs_built
from jkv.engine.lockstep import Recorder, Replayer, signature

LOG = logging.getLogger("jkv.serve")
HEARTBEAT_S = 1.0
DRAIN_S = 3.0  # after a process is lost: for the 503s to reach their clients before the exit
LOST_EXIT = 3  # the status of a process whose group lost one of its processes
DIVERGED_EXIT = 4  # a follower that cannot run the leader's steps (another engine, a failed call)


def initialize(coordinator: str, num_processes: int, process_id: int, timeout: float) -> None:
    """`jax.distributed.initialize` with gloo for CPU collectives (before any JAX backend
    starts); the flags already `check`ed."""
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator,
        num_processes=num_processes,
        process_id=process_id,
        initialization_timeout=max(1, int(timeout)),
    )


def check(coordinator, num_processes, process_id) -> tuple[str, int]:
    """(host, port) of `coordinator` ("HOST:PORT"), the three flags checked."""
    host, _, port = str(coordinator).rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65535:
        raise ValueError(f"--coordinator {coordinator!r}: expected HOST:PORT (PORT < 65535)")
    if isinstance(num_processes, bool) or not isinstance(num_processes, int) or num_processes < 2:
        raise ValueError(f"--num-processes {num_processes!r}: expected an int >= 2")
    if not isinstance(process_id, int) or not 0 <= process_id < num_processes:
        raise ValueError(
            f"--process-id {process_id!r}: expected an int in [0, {num_processes - 1}]"
        )
    return host, int(port)


# Where a thread is while JAX builds a program: tracing, lowering, XLA compiling.
_BUILDING = tuple(
    os.path.join("jax", "_src", *parts)
    for parts in (
        ("compiler.py",),
        ("interpreters", "partial_eval.py"),
        ("interpreters", "mlir.py"),
    )
)


def building(thread_id: int) -> bool:
    """Whether the thread `thread_id` is inside JAX building a program, now (its stack)."""
    frame = sys._current_frames().get(thread_id)
    while frame is not None:
        if frame.f_code.co_filename.endswith(_BUILDING):
            return True
        frame = frame.f_back
    return False


class StepWatch:
    """Whether this process's engine is stuck in a step: inside one (`enter` .. `leave`) for
    `timeout` seconds in which the process built no program and its stepping thread was never
    seen building one. The group's processes build the same programs at the same points, so a
    compile, however long one program takes, is progress; a collective waiting for a hung
    process is not."""

    def __init__(self, timeout: float):
        self.timeout = timeout
        self._since: float | None = None
        self._built = 0
        self._thread = 0
        self._lock = threading.Lock()

    def enter(self) -> None:
        with self._lock:
            self._since, self._built = time.monotonic(), programs_built()
            self._thread = threading.get_ident()

    def leave(self) -> None:
        with self._lock:
            self._since = None

    def stuck(self) -> str | None:
        """Why the step is stuck, or None."""
        with self._lock:
            if self._since is None:
                return None
            now, built = time.monotonic(), programs_built()
            if built != self._built or building(self._thread):  # the clock starts again
                self._since, self._built = now, built
            if now - self._since <= self.timeout:
                return None
            return f"stuck in a step for {now - self._since:.0f} s without compiling"


class Channel:
    """Length-prefixed pickles over one TCP connection; sends from any thread."""

    def __init__(self, sock: socket.socket):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock, self._send = sock, threading.Lock()

    def send(self, obj) -> None:
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        with self._send:
            self.sock.sendall(struct.pack("!I", len(data)) + data)

    def recv(self, timeout: float):
        """The next message; raises EOFError (closed), TimeoutError (silent `timeout` s)."""
        self.sock.settimeout(timeout)
        (n,) = struct.unpack("!I", self._exact(4))
        return pickle.loads(self._exact(n))

    def _exact(self, n: int) -> bytes:
        out = bytearray()
        while len(out) < n:
            try:
                got = self.sock.recv(n - len(out))
            except TimeoutError:
                raise
            except OSError as err:
                raise EOFError(str(err)) from None
            if not got:
                raise EOFError("the connection closed")
            out += got
        return bytes(out)

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


def _beat(channels, stopped: threading.Event, on_error, watch: StepWatch, on_stuck) -> None:
    """A heartbeat to each channel every HEARTBEAT_S until `stopped`, or until this process's
    step is stuck (`watch`): then `on_stuck(why)` and no more beats."""
    while not stopped.wait(HEARTBEAT_S):
        why = watch.stuck()
        if why is not None:
            return on_stuck(why)
        for i, ch in channels:
            try:
                ch.send(("beat",))
            except OSError as err:
                on_error(i, f"heartbeat failed: {err}")


class Leader:
    """Process 0's side: accepts the followers, sends every step's messages, watches them."""

    def __init__(
        self, host: str, port: int, num_processes: int, timeout: float, *, start_timeout=None,
        exit=os._exit,
    ):  # fmt: skip
        """`timeout`: a silent follower's; `start_timeout` (default: the same) the followers'
        to connect; `exit`: what ends the process when one is lost."""
        self.timeout, self._exit = timeout, exit
        start = timeout if start_timeout is None else start_timeout
        self.lost_reason: str | None = None
        self.on_lost = None  # called once, from a watching thread, with the reason
        self._steps = 0
        self._engine = None
        self._recorder = Recorder()
        self.watch = StepWatch(timeout)
        self._stopped = threading.Event()
        self._lost_lock = threading.Lock()
        self.channels: list[tuple[int, Channel]] = []
        server = socket.create_server((host, port))
        server.settimeout(start)
        try:
            while len(self.channels) < num_processes - 1:
                try:
                    sock, _ = server.accept()
                except TimeoutError:
                    have = sorted(i for i, _ in self.channels)
                    raise TimeoutError(
                        f"the group: {num_processes - 1} followers expected on "
                        f"{host}:{port} within {start:g} s, {len(have)} came ({have})"
                    ) from None
                ch = Channel(sock)
                kind, pid = ch.recv(start)
                assert kind == "hello", kind
                self.channels.append((pid, ch))
        finally:
            server.close()
        for pid, ch in self.channels:
            ch.send(("welcome",))
            threading.Thread(target=self._watch, args=(pid, ch), daemon=True).start()
        threading.Thread(
            target=_beat, args=(self.channels, self._stopped, self.lost, self.watch,
                                lambda why: self.lost(0, why)), daemon=True,
        ).start()  # fmt: skip
        LOG.info("the group: %d processes", num_processes)

    def attach(self, engine) -> None:
        """`engine`'s steps become the group's: its shapes go to every follower (which refuses
        to run them on an engine of other shapes), then each step's device work."""
        self._engine = engine
        engine.lockstep = self
        self._send(("engine", signature(engine)))

    # -- the engine's hooks (`Engine.lockstep`), called with its step lock held --

    def tick(self) -> None:
        """Before each step."""
        if self.lost_reason is not None:
            raise RuntimeError(self.lost_reason)
        self.watch.enter()
        self._steps += 1
        self._recorder.begin(self._engine)
        self._send(("tick", self._steps))

    def call(self, fn, args, kwargs) -> None:
        """A device call of the step, before it runs here (`jkv.engine.lockstep.run`)."""
        self._send(self._recorder.call(fn, args, kwargs))

    def made(self, out) -> None:
        self._recorder.made(out)

    def read(self, x) -> None:
        """A read of a device value back to the host, before it happens here."""
        self._send(("read", self._recorder.encode(x)))

    def stepped(self) -> None:
        self.watch.leave()
        if self.lost_reason is None:
            try:
                self._send(self._recorder.end(self._engine))
            except RuntimeError:
                pass  # lost: the next tick says so

    def _send(self, frame) -> None:
        for pid, ch in self.channels:
            try:
                ch.send(frame)
            except OSError as err:
                self.lost(pid, f"sending a step failed: {err}")
                raise RuntimeError(self.lost_reason) from None

    # -- failures and the end --

    def _watch(self, pid: int, ch: Channel) -> None:
        while not self._stopped.is_set():
            try:
                ch.recv(self.timeout)
            except TimeoutError:
                self.lost(pid, f"silent for {self.timeout:g} s")
                return
            except EOFError as err:
                if not self._stopped.is_set():
                    self.lost(pid, f"its channel closed ({err})")
                return

    def lost(self, pid: int, why: str) -> None:
        with self._lost_lock:
            if self.lost_reason is not None or self._stopped.is_set():
                return
            self.lost_reason = f"process {pid} of the serving group is lost: {why}"
        LOG.error("%s; in-flight requests end with 503, exiting in %g s", self.lost_reason,
                  DRAIN_S)  # fmt: skip
        if self.on_lost is not None:
            self.on_lost(self.lost_reason)
        threading.Timer(DRAIN_S, self._exit, (LOST_EXIT,)).start()

    def stop(self) -> None:
        """Tells every follower to stop (a graceful shutdown)."""
        self._stopped.set()
        for _, ch in self.channels:
            try:
                ch.send(("stop",))
            except OSError:
                pass


class Follower:
    """Process I's side (I > 0): replays the leader's steps into its own engine."""

    def __init__(self, host: str, port: int, process_id: int, timeout: float):
        self.timeout, self.process_id = timeout, process_id
        self._step = 0
        self.watch = StepWatch(timeout)
        deadline = time.monotonic() + timeout
        while True:
            try:
                sock = socket.create_connection((host, port), timeout=5)
                break
            except OSError as err:
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"the group: no leader on {host}:{port} within {timeout:g} s ({err})"
                    ) from None
                time.sleep(0.2)
        self.channel = Channel(sock)
        self.channel.send(("hello", process_id))
        kind = self.channel.recv(timeout)[0]
        assert kind == "welcome", kind
        self.frames: queue.Queue = queue.Queue()
        self._stopped = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(
            target=_beat, args=([(0, self.channel)], self._stopped, self._leader_lost, self.watch,
                                self._stuck), daemon=True,
        ).start()  # fmt: skip

    def _read(self) -> None:
        while True:
            try:
                frame = self.channel.recv(self.timeout)
            except TimeoutError:
                return self._leader_lost(0, f"silent for {self.timeout:g} s")
            except EOFError as err:
                return self._leader_lost(0, f"its channel closed ({err})")
            if frame[0] != "beat":
                self.frames.put(frame)
            if frame[0] == "stop":
                return

    def _leader_lost(self, _pid, why: str) -> None:
        if self._stopped.is_set():
            return
        LOG.error("process %d: the leader is lost: %s; exiting", self.process_id, why)
        os._exit(LOST_EXIT)

    def _stuck(self, why: str) -> None:
        LOG.error("process %d: %s; exiting", self.process_id, why)
        os._exit(LOST_EXIT)

    def serve(self, engine) -> None:
        """Runs the leader's steps on `engine`'s arrays (`jkv.engine.lockstep.Replayer`), until
        the leader says stop. Exits with status 4 when `engine`'s shapes differ from the
        leader's, or when it cannot run one of the leader's calls."""
        replay, kind = Replayer(engine), None
        while True:
            frame = self.frames.get()
            kind = frame[0]
            if kind == "stop":
                self._stopped.set()
                LOG.info("process %d: the leader stopped the group", self.process_id)
                return
            if kind == "engine":
                if frame[1] != signature(engine):
                    self._diverged("this process's engine differs from the leader's (its "
                                   f"shapes, kv dtype or page size): {signature(engine)} != "
                                   f"{frame[1]}")  # fmt: skip
                continue
            if kind == "tick":
                self._step = frame[1]
                replay.begin()
                continue
            self.watch.enter()  # inside one of the leader's calls (a collective maybe)
            try:
                if kind == "call":
                    replay.call(frame[1], frame[2])
                elif kind == "read":
                    replay.read(frame[1])
                else:  # "end": the step's pool and last tokens
                    replay.end(frame[1])
            except Exception as err:  # noqa: BLE001 - this process cannot follow
                what = frame[1] if kind == "call" else kind
                self._diverged(f"the leader's {what} failed here: {type(err).__name__}: {err}")
            finally:
                self.watch.leave()

    def _diverged(self, why: str) -> None:
        LOG.error("process %d: step %d: %s; stopping", self.process_id, self._step, why)
        os._exit(DIVERGED_EXIT)
