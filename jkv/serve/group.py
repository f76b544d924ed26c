"""One engine over the devices of several processes (hosts): `jkv serve MODEL --coordinator
HOST:PORT --num-processes N --process-id I`, the same command on every host but for I.

JAX's multi-controller runtime (`jax.distributed`; on CPU, gloo collectives) makes the devices
of all N processes one mesh, and every process builds the same engine over it (`Engine(mesh=)`:
the pool sharded over kv heads), so each compiled step runs on all of them at once and every
process must run the same programs in the same order. Process 0, the leader, runs the HTTP
server. At each engine step it sends the others, the followers, what its step took in (the
requests added, with their settings, seeds included, and the aborts) over a TCP channel at
HOST:PORT+1; each follower hands them to its own engine and steps it. The engine's host side is
deterministic given its messages (`Engine._drain`, the scheduler: plain Python on ints), so every
process schedules the same rows and runs the same step, as sglang-jax's nodes do; only the
leader answers. Once the leader has planned a step, before running it, it sends the plan's
digest (rows, token spans, page blocks, preemptions); each follower plans its own step, then
waits for the leader's digest and compares before it runs anything: a follower whose plan
differs exits with status 4 before entering the step's collectives (never different programs,
and no collective left waiting on a diverged process), and the leader then sees it gone. A
follower still schedules for itself and checks the leader's plan; it does not run the leader's
plan without scheduling.

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
import zlib

from jkv.compile_time import programs_built

LOG = logging.getLogger("jkv.serve")
HEARTBEAT_S = 1.0
DRAIN_S = 3.0  # after a process is lost: for the 503s to reach their clients before the exit
LOST_EXIT = 3  # the status of a process whose group lost one of its processes
DIVERGED_EXIT = 4  # a follower whose plan differed from the leader's


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


def digest(plan) -> int:
    """What a step runs, in a word: its plain rows (`jkv.engine.plan.RowPlan`: request ids,
    tokens, page blocks, slots), and the requests it preempted (0: no step). Not a row's
    `epoch`: a process-wide serial, which counts every sequence the process ever made (a
    leader's warmup, say) and so differs between processes that plan the same step."""
    if plan is None:
        return 0
    rows = [r.row._replace(epoch=0) for r in plan.scheduled]
    key = repr((rows, [s.request_id for s in plan.preempted]))
    return zlib.crc32(key.encode())


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
        self._taken: list = []
        self._steps = 0
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

    # -- the engine's hooks (`Engine.lockstep`), called with its step lock held --

    def taken(self, kind: str, body) -> None:
        self._taken.append((kind, body))

    def tick(self) -> None:
        """Before each step: its messages to every follower."""
        if self.lost_reason is not None:
            raise RuntimeError(self.lost_reason)
        self.watch.enter()
        self._steps += 1
        self._send(("tick", self._steps, self._taken))
        self._taken = []

    def planned(self, plan) -> None:
        """The step is planned, not yet run: its digest to every follower, which checks its own
        plan against it before running it."""
        self._send(("plan", self._steps, digest(plan)))

    def stepped(self) -> None:
        self.watch.leave()

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

    # the engine's hooks: a follower's messages come from the leader
    def taken(self, kind: str, body) -> None:
        pass

    def tick(self) -> None:
        self.watch.enter()

    def planned(self, plan) -> None:
        """This process's plan for the step, before it runs: the leader's digest of its own
        must equal it, else this process stops before the step's collectives."""
        try:
            frame = self.frames.get(timeout=self.timeout)
        except queue.Empty:
            LOG.error("process %d: step %d: no plan from the leader in %g s; exiting",
                      self.process_id, self._step, self.timeout)  # fmt: skip
            os._exit(LOST_EXIT)
        if frame[0] == "stop":  # the group stops between the leader's tick and its plan
            self._stopped.set()
            LOG.info("process %d: the leader stopped the group", self.process_id)
            os._exit(0)
        mine = digest(plan)
        if frame[0] != "plan" or frame[2] != mine:
            theirs = frame[2] if frame[0] == "plan" else f"no step ({frame[0]})"
            LOG.error("process %d: step %d's plan differs from the leader's (%s != %s); "
                      "stopping before it runs", self.process_id, self._step, mine,
                      theirs)  # fmt: skip
            os._exit(DIVERGED_EXIT)

    def stepped(self) -> None:
        self.watch.leave()

    def serve(self, engine) -> None:
        """Steps `engine` as the leader steps its own, until the leader says stop."""
        engine.lockstep = self
        while True:
            frame = self.frames.get()
            if frame[0] == "stop":
                self._stopped.set()
                LOG.info("process %d: the leader stopped the group", self.process_id)
                return
            if frame[0] != "tick":  # the leader planned a step this process did not
                LOG.error("process %d: step %d: the leader ran a step this process planned "
                          "none for; stopping", self.process_id, self._step)  # fmt: skip
                os._exit(DIVERGED_EXIT)
            _, step, messages = frame
            self._step = step
            for kind, body in messages:
                try:
                    if kind == "add":
                        engine.add_request(**body)
                    else:
                        engine.abort(body)
                except Exception as err:  # the leader's engine took it: so must this one
                    LOG.error("process %d: step %d: the leader's %s failed here: %s: %s",
                              self.process_id, step, kind, type(err).__name__, err)  # fmt: skip
                    os._exit(DIVERGED_EXIT)
            engine.step()
