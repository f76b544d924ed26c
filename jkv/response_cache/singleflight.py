"""Single-flight: identical concurrent misses generate once.

In one process, the first caller of a key leads a `Flight`; later callers wait on its event
and share its result or its exception (an exception is never cached). Across processes a
Redis lease (`SET lease owner NX PX ms`) elects one generator; the others poll L2 with
backoff (`wait_for_peer`) and take over if the lease frees without a value, or generate
themselves once `timeout` passes, so a dead or slow leader costs time, never an answer.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

_FIRST_PAUSE_S = 0.005
_MAX_PAUSE_S = 0.1


class Flight:
    """One in-progress lookup-or-generation that other threads may wait on.

    The event is created only when a second caller arrives: most flights have none, and an
    Event costs more than the rest of a hit.
    """

    __slots__ = ("_event", "_result", "_error")

    def __init__(self) -> None:
        self._event: threading.Event | None = None
        self._result: Any = None
        self._error: BaseException | None = None

    def wait(self) -> Any:
        """Blocks until the leader finishes; returns its result or raises its exception."""
        if self._event is not None:
            self._event.wait()
        if self._error is not None:
            raise self._error
        return self._result


class SingleFlight:
    """Per-key flights within one process."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._flights: dict[str, Flight] = {}

    def begin(self, key: str) -> tuple[Flight, bool]:
        """Joins the key's flight, starting one if none is running.

        Returns:
            The flight and whether the caller leads it (and must call `finish`).
        """
        with self._lock:
            flight = self._flights.get(key)
            if flight is None:
                flight = self._flights[key] = Flight()
                return flight, True
            if flight._event is None:
                flight._event = threading.Event()
            return flight, False

    def finish(
        self, key: str, flight: Flight, result: Any = None, error: BaseException | None = None
    ) -> None:
        """Publishes the leader's outcome to its waiters and retires the flight."""
        flight._result, flight._error = result, error
        with self._lock:  # after this, no new waiter can find the flight or add an event
            if self._flights.get(key) is flight:
                del self._flights[key]
            event = flight._event
        if event is not None:
            event.set()

    def __len__(self) -> int:
        return len(self._flights)


def wait_for_peer(
    fetch: Callable[[], Any],
    try_lease: Callable[[], bool | None],
    timeout: float,
    sleep: Callable[[float], None] = time.sleep,
) -> tuple[Any, bool]:
    """Waits while another node holds the lease, polling L2 with exponential backoff.

    Args:
        fetch: reads the value from L2, None on a miss.
        try_lease: tries to take the lease; True taken, False held by someone, None when
            Redis is unavailable.
        timeout: seconds to wait at most.
        sleep: the pause function (tests may speed it up).

    Returns:
        (value, False) when the peer's value appeared; (None, True) when this node took over
        the lease; (None, False) when it timed out or Redis went away (generate unleased).
    """
    deadline = time.monotonic() + timeout
    pause = _FIRST_PAUSE_S
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return None, False
        sleep(min(pause, left))
        pause = min(pause * 2, _MAX_PAUSE_S)
        value = fetch()
        if value is not None:
            return value, False
        got = try_lease()
        if got is None:
            return None, False
        if got:
            return None, True
