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
