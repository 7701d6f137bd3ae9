"""The time a rank spends communicating (kept apart: the engine's API side imports it)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager


class CommClock:
    """Seconds this process spent in collectives (waiting for peers included): what a
    benchmark reports as the communication share. Exact for gloo, whose calls block;
    with nccl it counts only the launches."""

    def __init__(self) -> None:
        self.seconds = 0.0

    @contextmanager
    def timing(self) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds += time.perf_counter() - start


COMM = CommClock()
