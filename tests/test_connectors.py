"""Connectors move tensors stage to stage; the orchestrator only sees small handles."""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle

import pytest
import torch

from vllm_omni.transfer.connectors import InProcessConnector, SharedMemoryConnector


def payload(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(7, 33, generator=g)
    return {
        "hidden_states": hidden,
        "embeds_bf16": torch.randn(5, 16, generator=g).to(torch.bfloat16),
        "token_ids": torch.randint(0, 50_000, (13,), generator=g),
        "mask": torch.rand(9, generator=g) > 0.5,
        "strided": hidden.t(),  # not contiguous
        "empty": torch.empty(0, 4),
        "scalar": torch.tensor(3.5, dtype=torch.float64),
    }


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert list(a) == list(b)
    for name in a:
        assert a[name].dtype == b[name].dtype, name
        assert a[name].shape == b[name].shape, name
        assert torch.equal(a[name], b[name]), name


def shm_exists(segment: str) -> bool:
    return os.path.exists(f"/dev/shm/{segment}")


@pytest.mark.parametrize("connector", [SharedMemoryConnector(), InProcessConnector()])
def test_round_trip_every_dtype_and_layout(connector):
    data = payload(0)
    handle = connector.put(data)
    assert_same(connector.get(handle), data)


def test_read_once_then_released():
    conn = SharedMemoryConnector()
    handle = conn.put(payload(1))
    assert shm_exists(handle.segment)
    conn.get(handle)
    assert not shm_exists(handle.segment)
    with pytest.raises(FileNotFoundError):
        conn.get(handle)


def test_discard_releases_and_is_idempotent():
    conn = SharedMemoryConnector()
    handle = conn.put(payload(2))
    conn.discard(handle)
    assert not shm_exists(handle.segment)
    conn.discard(handle)


def _produce(queue, seed: int, big: bool) -> None:
    data = payload(seed)
    if big:
        data["big"] = torch.arange(4 * 1024 * 1024, dtype=torch.float32)  # 16 MiB
    queue.put(pickle.dumps(SharedMemoryConnector().put(data)))


def test_across_processes_with_small_handles():
    """A producer process puts and exits; the payload outlives it; only the handle (a few
    hundred bytes, whatever the payload size) crosses the process boundary."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_produce, args=(queue, 5, True))
    proc.start()
    raw = queue.get(timeout=120)
    proc.join(60)
    assert proc.exitcode == 0
    assert len(raw) < 2048
    handle = pickle.loads(raw)
    assert handle.nbytes > 16 * 1024 * 1024
    expected = payload(5)
    expected["big"] = torch.arange(4 * 1024 * 1024, dtype=torch.float32)
    assert_same(SharedMemoryConnector().get(handle), expected)
    assert not shm_exists(handle.segment)


def test_a_pool_reuses_a_segment_once_its_payload_is_read():
    conn = SharedMemoryConnector(pool_bytes=64 << 20)
    first = conn.put(payload(1))
    assert first.pooled and shm_exists(first.segment)
    unread = conn.put(payload(2))  # the first is not read yet: a segment of its own
    assert unread.segment != first.segment
    assert_same(SharedMemoryConnector().get(first), payload(1))
    assert shm_exists(first.segment)  # kept for the next payload, not unlinked
    again = conn.put(payload(3))
    assert again.segment == first.segment
    assert_same(SharedMemoryConnector().get(again), payload(3))
    SharedMemoryConnector().discard(unread)  # discarded: free again too
    assert conn.put(payload(4)).segment in (first.segment, unread.segment)
    conn.close()
    assert not shm_exists(first.segment) and not shm_exists(unread.segment)


def test_a_pool_past_its_bytes_hands_out_one_off_segments():
    conn = SharedMemoryConnector(pool_bytes=1 << 16)
    big = conn.put({"x": torch.zeros(1 << 16)})  # 256 KiB: over the pool's 64 KiB
    assert not big.pooled
    assert torch.equal(conn.get(big)["x"], torch.zeros(1 << 16))
    assert not shm_exists(big.segment)
    conn.close()


def test_read_in_place_holds_the_segment_until_the_tensors_are_gone():
    conn = SharedMemoryConnector(pool_bytes=64 << 20)
    handle = conn.put(payload(5))
    tensors = SharedMemoryConnector().get(handle, in_place=True)
    assert_same(tensors, payload(5))
    assert conn.put(payload(6)).segment != handle.segment  # still viewed: not reused
    view = tensors["hidden_states"][2:]  # a view of a view keeps it too
    del tensors
    assert conn.put(payload(7)).segment != handle.segment
    del view
    reused = conn.put(payload(8))
    assert reused.segment == handle.segment
    assert_same(SharedMemoryConnector().get(reused), payload(8))
    conn.close()


def _produce_pooled(queue, go, kill: bool) -> None:
    conn = SharedMemoryConnector(pool_bytes=64 << 20)
    queue.put(pickle.dumps(conn.put(payload(9))))
    go.wait(60)
    if kill:
        os.kill(os.getpid(), 9)  # no atexit: the pool is left behind


@pytest.mark.parametrize("kill", [False, True])
def test_a_pool_goes_with_its_producer(kill):
    """A producer that exits unlinks its pool; one killed leaves it, and the sweep (run once
    a stage's processes stopped) unlinks what belonged to dead processes only."""
    from vllm_omni.transfer.connectors import sweep_orphaned_pools

    ctx = mp.get_context("spawn")
    queue, go = ctx.Queue(), ctx.Event()
    proc = ctx.Process(target=_produce_pooled, args=(queue, go, kill))
    proc.start()
    handle = pickle.loads(queue.get(timeout=120))
    assert_same(SharedMemoryConnector().get(handle), payload(9))
    mine = SharedMemoryConnector(pool_bytes=1 << 20)
    alive = mine.put(payload(1))
    go.set()
    proc.join(60)
    assert shm_exists(handle.segment) == kill
    swept = sweep_orphaned_pools()
    assert not shm_exists(handle.segment)
    assert (handle.segment in swept) == kill
    assert shm_exists(alive.segment)  # this process lives: its pool stays
    mine.close()


def test_unread_payloads_are_the_ones_nobody_took():
    from vllm_omni.transfer.connectors import unread_payloads

    pool = SharedMemoryConnector(pool_bytes=64 << 20)
    waiting, viewed, read = pool.put(payload(1)), pool.put(payload(2)), pool.put(payload(3))
    one_off = SharedMemoryConnector().put(payload(4))
    tensors = SharedMemoryConnector().get(viewed, in_place=True)
    SharedMemoryConnector().get(read)
    found = unread_payloads()
    assert {waiting.segment, one_off.segment} <= found
    assert not {viewed.segment, read.segment} & found
    del tensors
    SharedMemoryConnector().discard(one_off)
    SharedMemoryConnector().discard(waiting)
    assert not {waiting.segment, one_off.segment} & unread_payloads()
    pool.close()
