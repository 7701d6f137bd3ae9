"""BatchSizer: learns, per batch key, how large a denoising batch still pays.

On a GPU a bigger batch is nearly free until the device fills; on a CPU one image of a large
DiT already saturates the cores, and a bigger batch only makes every request in it finish
later. The sizer measures the time per image of steps at each batch size (powers of two) and
keeps the limit at the smallest size that is within `gain` of the best per-image time seen.
It measures the next smaller (and larger) size now and then so the limit can move both ways.
Medians of the last few steps keep one noisy step from moving it.
"""

from __future__ import annotations

import statistics
from collections import defaultdict, deque


def size_class(images: int) -> int:
    """The largest power of two not above `images`."""
    return 1 << (max(images, 1).bit_length() - 1)


class BatchSizer:
    def __init__(self, max_size: int, gain: float = 0.05, window: int = 5, enough: int = 3):
        self.top = size_class(max_size)
        self.gain = gain
        self.enough = enough
        self._times: dict[tuple, dict[int, deque[float]]] = defaultdict(
            lambda: defaultdict(lambda: deque(maxlen=window))
        )
        self._limit: dict[tuple, int] = {}

    def record(self, key: tuple, images: int, seconds: float) -> None:
        self._times[key][size_class(images)].append(seconds / images)

    def _per_image(self, key: tuple, size: int) -> float | None:
        times = self._times[key].get(size)
        if times is None or len(times) < self.enough:
            return None
        return statistics.median(times)

    def limit(self, key: tuple) -> int:
        """The most images to put in the next batch of `key`."""
        limit = self._limit.get(key, self.top)
        here = self._per_image(key, limit)
        if here is None:
            return limit
        half, double = limit // 2, min(limit * 2, self.top)
        if half >= 1:
            smaller = self._per_image(key, half)
            if smaller is None:
                return half  # measure the smaller size before trusting this one
            if smaller <= here * (1 + self.gain):
                self._limit[key] = half  # a bigger batch does not pay: lower latency instead
                return half
        if double > limit:
            larger = self._per_image(key, double)
            if larger is None:
                return double  # see whether a bigger batch would pay now
            if larger < here * (1 - self.gain):
                self._limit[key] = double
                return double
        return limit
