"""Rank 0 of a parallel diffusion stage: the engine core starts the other ranks, and drives
them call by call.

The other ranks are worker processes (`python -m vllm_omni.engine.diffusion.parallel.worker`,
started with subprocess: the core is a daemonic multiprocessing child, which may not have
multiprocessing children). Each connects back to the core over a local socket (the calls
travel there) and joins the torch.distributed group (gloo on CPU, nccl on GPUs: the
tensors and the attention exchanges travel there). A rank that exits takes the stage down:
the core kills the others and exits, so the client fails every request in flight naming the
stage, as for any dead engine; a worker exits when the core is gone.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import subprocess
import sys
import threading
import time
from datetime import timedelta
from multiprocessing.connection import Connection, Listener
from multiprocessing.util import Finalize
from typing import Any

import torch
import torch.distributed as dist

from vllm_omni.engine.diffusion.cache import CacheSlot
from vllm_omni.engine.diffusion.parallel.clock import COMM
from vllm_omni.engine.diffusion.parallel.layout import Layout, rank_cores, rank_devices
from vllm_omni.engine.diffusion.parallel.rank import (
    Call,
    RankRuntime,
    TransformerSpec,
    strip_tensors,
)

logger = logging.getLogger(__name__)

AUTHKEY_ENV = "VLLM_OMNI_RANK_AUTHKEY"
START_TIMEOUT = 600.0  # seconds for every rank to load its transformer


def bind_rank(cores: list[int], device: str) -> None:
    """One rank's threads on its own cores (CPU), or its own GPU."""
    if device == "cpu":
        os.sched_setaffinity(0, set(cores))
        torch.set_num_threads(len(cores))
    else:
        torch.cuda.set_device(torch.device(device))


def backend(device: str) -> str:
    return "gloo" if device == "cpu" else "nccl"


class RankGroup:
    """The worker ranks of one stage, seen from rank 0."""

    def __init__(self, model: str, options: Any) -> None:
        self.layout = Layout.of(options)
        self.devices = rank_devices(options.device, self.layout.world)
        self.cores = rank_cores(options.cores, self.layout.world)
        self.closing = False
        authkey = secrets.token_bytes(16)
        self._listener = Listener(family="AF_UNIX", authkey=authkey)
        self._store = dist.TCPStore("127.0.0.1", 0, self.layout.world, is_master=True,
                                    wait_for_workers=False)
        env = {**os.environ, AUTHKEY_ENV: authkey.hex()}
        self.procs: dict[int, subprocess.Popen] = {}
        for rank in range(1, self.layout.world):
            spec = {
                "model": model, "dtype": options.dtype, "device": self.devices[rank],
                "quantization": options.quantization,
                "cores": self.cores[rank], "rank": rank, "layout": list(
                    (self.layout.ulysses, self.layout.ring, self.layout.cfg)),
                "store_port": self._store.port, "address": self._listener.address,
            }
            self.procs[rank] = subprocess.Popen(
                [sys.executable, "-m", "vllm_omni.engine.diffusion.parallel.worker",
                 json.dumps(spec)], env=env)
        self.conns: dict[int, Connection] = {}
        self._finalizer = Finalize(self, self.close, exitpriority=10)

    def connect(self, transformer, spec: TransformerSpec, modulated_input) -> RankRuntime:
        """Rank 0 joins the group once its own pipeline is loaded; returns when every rank
        has loaded its transformer (raises, with a worker's traceback, where one failed)."""
        bind_rank(self.cores[0], self.devices[0])
        accepted: list[Connection] = []
        threading.Thread(target=self._accept, args=(accepted,), daemon=True).start()
        self._wait(lambda: len(accepted) == len(self.procs), "connect")
        for conn in accepted:
            self.conns[conn.recv()] = conn
        dist.init_process_group(backend(self.devices[0]), store=self._store, rank=0,
                                world_size=self.layout.world, timeout=timedelta(hours=2))
        for rank, conn in self.conns.items():
            self._wait(lambda c=conn: c.poll(0), "load its transformer")
            reply = conn.recv()
            if reply != "ready":
                raise RuntimeError(f"rank {rank} failed to start:\n{reply}")
        runtime = RankRuntime(self.layout, 0, transformer, spec, modulated_input,
                              torch.device(self.devices[0]))
        for rank, proc in self.procs.items():
            threading.Thread(target=self._watch, args=(rank, proc), daemon=True,
                             name=f"rank-{rank}-watch").start()
        return runtime

    def _accept(self, accepted: list[Connection]) -> None:
        try:
            for _ in self.procs:
                accepted.append(self._listener.accept())
        except OSError:
            pass  # closed: start-up failed

    def _wait(self, done, what: str) -> None:
        deadline = time.monotonic() + START_TIMEOUT
        while not done():
            for rank, proc in self.procs.items():
                if proc.poll() is not None:
                    raise RuntimeError(f"rank {rank} exited with code {proc.returncode} "
                                       f"before it could {what} (its log is above)")
            if time.monotonic() > deadline:
                raise RuntimeError(f"ranks did not {what} within {START_TIMEOUT:.0f} s")
            time.sleep(0.05)

    def _watch(self, rank: int, proc: subprocess.Popen) -> None:
        code = proc.wait()
        if self.closing:
            return
        # A collective with a dead peer may never return: the stage cannot go on. Its
        # client sees the core exit and fails the requests in flight naming the stage.
        logger.error("rank %d of this diffusion stage exited with code %s: stopping the "
                     "stage's engine", rank, code)
        self.kill()
        os._exit(1)

    def send(self, call: Call) -> None:
        for conn in self.conns.values():
            conn.send(call)

    def kill(self) -> None:
        self.closing = True
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
        for proc in self.procs.values():
            proc.wait()

    def close(self) -> None:
        if self.closing:
            return
        self.closing = True
        for conn in self.conns.values():
            try:
                conn.send(None)
            except OSError:
                pass
        deadline = time.monotonic() + 5
        for proc in self.procs.values():
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._listener.close()


class ParallelTransformer:
    """The adapter's transformer call, run over every rank of the stage (on rank 0): a
    TransformerExecutor (engine/diffusion/executor.py)."""

    def __init__(self, ranks: RankGroup, transformer, spec: TransformerSpec,
                 modulated_input) -> None:
        self.ranks, self.spec = ranks, spec
        self.runtime = ranks.connect(transformer, spec, modulated_input)
        # The rank's runtime holds the cache hooks on this rank's transformer.
        self.cache = self.runtime.cache
        self.sequence_parallel = ranks.layout.sequence
        self._released: list[str] = []

    def release(self, request_id: str) -> None:
        """Forget a request's cache slots on the other ranks (sent with the next call)."""
        self._released.append(request_id)

    def __call__(self, kwargs: dict[str, Any], slots: list[CacheSlot | None],
                 timesteps: list[float], cfg: bool) -> torch.Tensor:
        meta, tensors = strip_tensors(kwargs)
        call = Call(meta, [None if s is None else (s.key, s.config) for s in slots],
                    timesteps, cfg, self._released)
        self._released = []
        self.ranks.send(call)
        try:
            own = self.runtime.execute(call, tensors, slots)
            return self._gather(call, own, slots)
        except Exception:
            # The other ranks may wait in a collective this rank will never join.
            logger.exception("a parallel transformer call failed: stopping the stage's engine")
            self.ranks.kill()
            os._exit(1)

    def _gather(self, call: Call, own: torch.Tensor, slots) -> torch.Tensor:
        lay = self.ranks.layout
        groups = lay.cfg if call.cfg and lay.cfg > 1 else 1
        parts = []
        for c in range(groups):
            shards = []
            for rank in lay.sequence_ranks(c):
                if rank == 0:
                    shards.append(own)
                    continue
                piece = torch.empty_like(own)
                with COMM.timing():
                    dist.recv(piece, rank)
                shards.append(piece)
            dim = self.spec.output_sequence_dim
            parts.append(torch.cat(shards, dim) if len(shards) > 1 else shards[0])
            if c > 0:
                half = len(call.timesteps) // 2
                rows = range(c * half, (c + 1) * half)
                mine = [slots[r] for r in rows]
                if any(mine):
                    flags = torch.empty(len(rows), dtype=torch.long, device=own.device)
                    with COMM.timing():
                        dist.recv(flags, lay.sequence_ranks(c)[0])
                    for slot, cached in zip(mine, flags.tolist(), strict=True):
                        if slot is not None:
                            slot.count(bool(cached))
        return torch.cat(parts) if len(parts) > 1 else parts[0]
