"""BatchSizer against synthetic step costs: it settles where bigger batches stop paying."""

from __future__ import annotations

import pytest

from vllm_omni.engine.diffusion.batch_sizer import BatchSizer, size_class


def settle(per_image: dict[int, float], top: int, steps: int = 80) -> int:
    sizer = BatchSizer(top)
    for _ in range(steps):
        n = sizer.limit(("k",))
        sizer.record(("k",), n, n * per_image[n])
    return sizer.limit(("k",))


def test_size_class():
    assert [size_class(n) for n in (0, 1, 2, 3, 7, 8, 9, 16)] == [1, 1, 2, 2, 4, 8, 8, 16]


@pytest.mark.parametrize(
    "per_image, expected",
    [
        # A transformer-bound model on a CPU (flux-small here): batching does not pay.
        ({1: 238, 2: 237, 4: 235, 8: 241, 16: 253}, 1),
        # Overhead-bound (flux-tiny here): gains up to 8, slower at 16.
        ({1: 3.4, 2: 2.9, 4: 2.7, 8: 2.5, 16: 3.2}, 8),
        # GPU-like: every doubling pays.
        ({1: 8.0, 2: 4.0, 4: 2.0, 8: 1.0, 16: 0.5}, 16),
    ],
)
def test_settles_where_batching_stops_paying(per_image, expected):
    assert settle(per_image, 16) == expected


def test_one_slow_step_does_not_move_the_limit():
    sizer = BatchSizer(8)
    cost = {1: 8.0, 2: 4.0, 4: 2.0, 8: 1.0}
    for i in range(40):
        n = sizer.limit(("k",))
        spike = 10.0 if i == 30 else 1.0  # the machine stalls once
        sizer.record(("k",), n, n * cost[n] * spike)
    assert sizer.limit(("k",)) == 8


def test_keys_learn_separately():
    sizer = BatchSizer(8)
    for _ in range(60):
        for key, cost in ((("a",), {1: 1, 2: 1, 4: 1, 8: 1}), (("b",), {1: 8, 2: 4, 4: 2, 8: 1})):
            n = sizer.limit(key)
            sizer.record(key, n, n * cost[n])
    assert sizer.limit(("a",)) == 1 and sizer.limit(("b",)) == 8
