"""Several ranks per AR stage: vLLM's tensor / pipeline parallelism, checked and bound.

vLLM runs `tensor_parallel_size x pipeline_parallel_size` worker processes under one engine
core (its multiprocessing executor, gloo on CPU, nccl on GPUs). Two things are added here:

- Checks before any engine starts, worded per stage: the ranks must split the model's
  attention and KV heads, and each rank needs a core of its own on CPU (a GPU on GPUs).
- CPU thread binding. vLLM's CPU executor binds each rank's OpenMP threads from
  VLLM_CPU_OMP_THREADS_BIND; its default ("auto") puts one rank per NUMA node and refuses
  more ranks than nodes, so TP=2 fails on a one-node machine. Where the user did not set the
  variable, a stage gets one core set per rank: its `placement.cores` (else the cores this
  process may run on) split evenly over its ranks.

The variable is read by the executor inside the engine core process, which inherits this
process' environment when AsyncLLM spawns it. So a stage's value must be in os.environ while
its engine starts, and two stages with different values must not start at the same time:
`engine_environment` lets stages that need the same environment start together and makes
the others wait. With VLLM_ENABLE_V1_MULTIPROCESSING=0 the engine core runs in this process
and vLLM caches its environment after the first engine starts, so bindings cannot differ
between stages: that case is refused.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from typing import Any

from vllm_omni.config.schema import StageConfig

BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"


def world_size(engine_args: Any) -> int:
    """Worker processes (ranks) of one engine: tensor x pipeline parallel."""
    return int(engine_args.tensor_parallel_size) * int(engine_args.pipeline_parallel_size)


def stage_cores(stage: StageConfig) -> list[int]:
    """The CPU cores a stage's ranks share: its placement's, else this process' own."""
    if stage.placement is not None and stage.placement.cores:
        return list(stage.placement.cores)
    return sorted(os.sched_getaffinity(0))


def cpu_binding(stage: StageConfig, ranks: int) -> str | None:
    """VLLM_CPU_OMP_THREADS_BIND for the stage's engine ("0-3|4-7": one set per rank), or
    None where vLLM's own default is right: the user set the variable, or a single rank
    without `placement.cores` (vLLM then binds it to the NUMA node and keeps a core free
    for the engine core's scheduler loop)."""
    if user_value(BIND_ENV) is not None:
        return None
    if ranks == 1 and not (stage.placement and stage.placement.cores):
        return None
    cores = stage_cores(stage)
    per_rank = len(cores) // ranks
    if per_rank == 0:
        return None  # refused by parallel_problems before anything starts
    return "|".join(",".join(str(c) for c in cores[i * per_rank : (i + 1) * per_rank])
                    for i in range(ranks))


def parallel_problems(stage: StageConfig, model_config: Any, tp: int, pp: int,
                      device: str) -> list[str]:
    """What keeps a stage from running with `tp` x `pp` ranks, as sentences naming it.
    `model_config` is vLLM's ModelConfig of the stage."""
    name, problems = repr(stage.name), []
    text = model_config.hf_text_config
    heads = getattr(text, "num_attention_heads", None)
    kv_heads = model_config.get_total_num_kv_heads()
    if heads and heads % tp:
        problems.append(f"stage {name}: tensor_parallel_size {tp} does not divide the "
                        f"model's {heads} attention heads")
    elif kv_heads and kv_heads % tp and tp % kv_heads:
        problems.append(f"stage {name}: tensor_parallel_size {tp} neither divides the model's "
                        f"{kv_heads} KV heads nor is a multiple of them")
    layers = getattr(text, "num_hidden_layers", None)
    if layers and pp > layers:
        problems.append(f"stage {name}: pipeline_parallel_size {pp} is more than the model's "
                        f"{layers} layers")
    if pp > 1 and (stage.keeps_hidden_states or stage.step_inputs):
        problems.append(f"stage {name}: pipeline_parallel_size {pp} with hidden_states or "
                        "step_inputs: the embeddings and the final norm would sit on different "
                        "ranks; use tensor_parallel_size")
    ranks = tp * pp
    if device == "cpu":
        if stage.placement is not None and stage.placement.cores:
            allowed = os.sched_getaffinity(0)
            foreign = sorted(set(stage.placement.cores) - allowed)
            if foreign:
                problems.append(f"stage {name}: placement.cores {foreign} are not among the "
                                f"cores this process may use {sorted(allowed)}")
        given = user_value(BIND_ENV)
        if given is not None and given not in ("auto", "nobind"):
            if len(given.split("|")) != ranks:
                problems.append(f"stage {name}: {BIND_ENV}={given!r} names "
                                f"{len(given.split('|'))} core set(s), the stage has {ranks} "
                                f"rank(s) (tensor_parallel_size {tp} x "
                                f"pipeline_parallel_size {pp})")
        elif given is None and ranks > 1:
            cores = stage_cores(stage)
            if len(cores) < ranks:
                where = "placement.cores" if stage.placement and stage.placement.cores \
                    else "this process may use"
                problems.append(f"stage {name}: tensor_parallel_size {tp} x "
                                f"pipeline_parallel_size {pp} needs {ranks} cores, one per "
                                f"rank; {len(cores)} core(s) {where}: {cores}")
    elif ranks > 1:
        import torch

        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count < ranks:
            problems.append(f"stage {name}: tensor_parallel_size {tp} x pipeline_parallel_size "
                            f"{pp} needs {ranks} GPUs, one per rank; {count} visible")
    return problems


def in_process_engines() -> bool:
    """True when vLLM runs engine cores inside this process (its environment is then cached
    after the first engine starts)."""
    return os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1") == "0"


def binding_conflicts(bindings: dict[str, str | None]) -> list[str]:
    """Stages whose bindings cannot all be had in one process (in-process engines)."""
    if not in_process_engines():
        return []
    values = {v for v in bindings.values() if v is not None}
    if not values or len(bindings) == 1:
        return []
    listed = ", ".join(f"{s} {v or 'vLLM default'}" for s, v in bindings.items())
    return [f"stages {listed}: with VLLM_ENABLE_V1_MULTIPROCESSING=0 vLLM reads {BIND_ENV} "
            f"once per process, so AR stages cannot be bound differently; set {BIND_ENV} "
            "yourself or run engines in their own processes"]


_lock = threading.Condition()
_held: dict[str, tuple[str | None, int]] = {}  # variable -> (value, holders)
_saved: dict[str, str | None] = {}  # what the variables were before the first holder


def user_value(key: str) -> str | None:
    """An environment variable as the user set it (not as a starting stage holds it)."""
    with _lock:
        return _saved[key] if key in _held else os.environ.get(key)


@contextlib.contextmanager
def engine_environment(env: dict[str, str | None]) -> Iterator[None]:
    """Hold `env` (None: unset) in os.environ while an engine starts. Starts that need the
    same values run together; one that needs other values waits for them to finish."""
    with _lock:
        _lock.wait_for(lambda: all(_held.get(k, (v, 0))[0] == v for k, v in env.items()))
        for key, value in env.items():
            held = _held.get(key)
            if held is None:
                _saved[key] = os.environ.get(key)
                _set(key, value)
            _held[key] = (value, (held[1] if held else 0) + 1)
    try:
        yield
    finally:
        with _lock:
            for key in env:
                value, count = _held[key]
                if count == 1:
                    del _held[key]
                    _set(key, _saved.pop(key))
                else:
                    _held[key] = (value, count - 1)
            _lock.notify_all()


def _set(key: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(key, None)
    else:
        os.environ[key] = value
