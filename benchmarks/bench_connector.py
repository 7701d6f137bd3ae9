"""The cost of one stage hop: tensors through the shared-memory connector, against a plain
in-memory copy and against pickling them through a multiprocessing pipe (what a design that
sends payloads through a central process pays at each hop).

    python benchmarks/bench_connector.py

Each payload crosses a real process boundary: a producer process puts it and sends the
handle (or, for the pipe, the pickled tensors); the consumer measures from the producer's
start of `put` to having the tensors in hand.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import pickle
import statistics
import time

import torch

from vllm_omni.transfer.connectors import SharedMemoryConnector

SIZES_MB = [1, 16, 128]


def make(size_mb: int) -> dict[str, torch.Tensor]:
    n = size_mb * 1024 * 1024 // 2
    return {"hidden_states": torch.ones(n // 1024, 1024, dtype=torch.bfloat16)}


def producer(conn, size_mb: int, rounds: int, mode: str) -> None:
    data = make(size_mb)
    shm = SharedMemoryConnector(pool_bytes=(1 << 30) if mode.startswith("pool") else 0)
    for _ in range(rounds):
        conn.recv()  # go
        start = time.perf_counter()
        if mode != "pipe":
            conn.send((start, pickle.dumps(shm.put(data))))
        else:
            conn.send((start, pickle.dumps(data, protocol=pickle.HIGHEST_PROTOCOL)))


def across(size_mb: int, rounds: int, mode: str) -> list[float]:
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=producer, args=(there, size_mb, rounds, mode))
    proc.start()
    shm = SharedMemoryConnector()
    times = []
    for _ in range(rounds):
        here.send("go")
        start, raw = here.recv()
        obj = pickle.loads(raw)
        tensors = obj if mode == "pipe" else shm.get(obj, in_place=mode == "pool_in_place")
        assert tensors["hidden_states"].numel() * 2 == size_mb * 1024 * 1024
        times.append(time.perf_counter() - start)
        del tensors  # an in-place read frees its segment for the next round
    proc.join()
    return times


def in_memory(size_mb: int, rounds: int) -> list[float]:
    data = make(size_mb)
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        {k: v.clone() for k, v in data.items()}
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = []
    for size in SIZES_MB:
        row = {"size_mb": size}
        for name, times in [
            ("copy", in_memory(size, args.rounds)),
            ("shm", across(size, args.rounds, "shm")),
            ("pool", across(size, args.rounds, "pool")),
            ("pool_in_place", across(size, args.rounds, "pool_in_place")),
            ("pipe_pickle", across(size, args.rounds, "pipe")),
        ]:
            med = statistics.median(times)
            row[f"{name}_ms"] = round(1000 * med, 3)
            row[f"{name}_gb_per_s"] = round(size / 1024 / med, 2)
        rows.append(row)
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
