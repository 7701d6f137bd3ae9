"""The step-level scheduler on its own: admission, grouping, limits, order."""

from __future__ import annotations

import pytest
import torch

from vllm_omni.engine.diffusion.params import DiffusionParams
from vllm_omni.engine.diffusion.request import DiffusionRequest
from vllm_omni.engine.diffusion.scheduler import DiffusionScheduler


def request(rid: str, key: tuple = ("64x64",), images: int = 1, steps: int = 3, cost: int = 16):
    r = DiffusionRequest(rid, "p", DiffusionParams(num_images=images))
    r.key, r.cost, r.timesteps = key, cost, torch.arange(steps)
    return r


def advance(batch):
    for r in batch:
        r.step += 1


def test_admission_is_fifo_and_bounded():
    s = DiffusionScheduler(max_batch_size=8, max_batch_cost=1 << 30, max_running=2)
    for rid in "abc":
        s.add(request(rid))
    assert [r.request_id for r in s.admit()] == ["a", "b"]
    assert s.admit() == []
    s.finish(s.running["a"])
    assert [r.request_id for r in s.admit()] == ["c"]


def test_batch_is_the_oldest_requests_group():
    s = DiffusionScheduler(max_batch_size=8, max_batch_cost=1 << 30, max_running=8)
    for rid, key in [("a", "small"), ("b", "big"), ("c", "small")]:
        s.add(request(rid, key=(key,)))
    s.admit()
    assert [r.request_id for r in s.pick_batch()] == ["a", "c"]


def test_limits_on_images_and_cost():
    s = DiffusionScheduler(max_batch_size=3, max_batch_cost=40, max_running=8)
    s.add(request("a", images=2))
    s.add(request("b", images=2))  # would make 4 images
    s.admit()
    assert [r.request_id for r in s.pick_batch()] == ["a"]
    s = DiffusionScheduler(max_batch_size=8, max_batch_cost=40, max_running=8)
    for rid in "abc":
        s.add(request(rid, cost=16))  # three would cost 48
    s.admit()
    assert [r.request_id for r in s.pick_batch()] == ["a", "b"]
    # One request larger than the budget still runs (alone), rather than never.
    s = DiffusionScheduler(max_batch_size=1, max_batch_cost=8, max_running=8)
    s.add(request("huge", images=4, cost=999))
    s.admit()
    assert [r.request_id for r in s.pick_batch()] == ["huge"]


def test_no_starvation_of_another_shape():
    """Requests of the first shape keep arriving; the other shape still finishes in order."""
    s = DiffusionScheduler(max_batch_size=2, max_batch_cost=1 << 30, max_running=8)
    s.add(request("small-0", key=("s",)))
    s.add(request("big", key=("b",)))
    s.admit()
    done, n = [], 1
    for _ in range(20):
        batch = s.pick_batch()
        advance(batch)
        for group in s.denoised():
            for r in group:
                s.finish(r)
                done.append(r.request_id)
        s.add(request(f"small-{n}", key=("s",)))
        n += 1
        s.admit()
    assert "big" in done
    assert done.index("big") <= 1


def test_abort_removes_waiting_and_running():
    s = DiffusionScheduler(max_batch_size=8, max_batch_cost=1 << 30, max_running=1)
    s.add(request("a"))
    s.add(request("b"))
    s.admit()
    assert s.abort("b").request_id == "b"
    assert s.abort("a").request_id == "a"
    assert s.abort("a") is None
    assert not s.has_work


def test_priority_policy_serves_the_lowest_value_first_then_the_oldest():
    s = DiffusionScheduler(max_batch_size=1, max_batch_cost=1 << 30, max_running=2,
                           policy="priority")
    for rid, priority in [("a", 0), ("b", 5), ("c", -1), ("d", 0)]:
        r = request(rid)
        r.params.priority = priority
        s.add(r)
    assert [r.request_id for r in s.admit()] == ["c", "a"]
    assert [r.request_id for r in s.pick_batch()] == ["c"]
    s.finish(s.running["c"])
    assert [r.request_id for r in s.admit()] == ["d"]
    fcfs = DiffusionScheduler(max_batch_size=1, max_batch_cost=1 << 30, max_running=2)
    for rid, priority in [("a", 3), ("b", 0)]:
        r = request(rid)
        r.params.priority = priority
        fcfs.add(r)
    assert [r.request_id for r in fcfs.admit()] == ["a", "b"]  # priority ignored
    assert [r.request_id for r in fcfs.pick_batch()] == ["a"]


def test_an_unknown_policy_is_refused():
    with pytest.raises(ValueError, match=r"must be one of \['fcfs', 'priority'\]"):
        DiffusionScheduler(max_batch_size=1, max_batch_cost=1, max_running=1, policy="lifo")
