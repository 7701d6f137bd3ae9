"""The worker class of vllm-omni's AR stages (vLLM's `worker_cls`): vLLM's worker for this
platform plus hidden states out (hidden_states.py) and per-step inputs in (step_inputs.py).
Both are inert for requests that do not ask for them. They read the V1 model runner's batch
layout (`input_batch.req_ids`, `requests`), which the stage selects (VLLM_USE_V2_MODEL_RUNNER=0).
"""

from __future__ import annotations

from vllm.platforms import current_platform

from vllm_omni.engine.ar.hidden_states import HiddenStatesMixin
from vllm_omni.engine.ar.step_inputs import StepInputsMixin


def worker_class_path() -> str:
    """The `worker_cls` engine arg for this platform."""
    return f"{__name__}.{'CPU' if current_platform.is_cpu() else 'GPU'}OmniWorker"


def __getattr__(name: str):
    # Built lazily: importing a platform's worker module pulls in its whole runtime.
    if name == "CPUOmniWorker":
        from vllm.v1.worker.cpu_worker import CPUWorker as base
    elif name == "GPUOmniWorker":
        from vllm.v1.worker.gpu_worker import Worker as base
    else:
        raise AttributeError(name)
    return type(name, (HiddenStatesMixin, StepInputsMixin, base), {"__module__": __name__})
