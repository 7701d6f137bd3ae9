"""Hidden states out of an AR stage, through vLLM's `worker_cls` extension point.

The worker subclass hooks the model's final norm, splits each step's rows by request (the
model runner lays a step's tokens out request by request, in input-batch order), and keeps
the rows of requests that asked for them (`SamplingParams.extra_args["omni_hidden_states"]`
= a key). Prompt rows come first, then one row per decode step: the layout of HF's
`hidden_states[-1]`, where the last sampled token has no row yet.

When the request is done the orchestrator calls `take_hidden_states(key)` over
`collective_rpc`; the worker writes the rows to shared memory and returns only a small
handle, so the tensors never pass through the engine core or the API process.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.platforms import current_platform

from vllm_omni.orchestrator.connectors import SharedMemoryConnector, ShmHandle, TensorLayout

REQUEST_KEY = "omni_hidden_states"


def _final_norm(model: torch.nn.Module) -> torch.nn.Module:
    for path in ("model.norm", "language_model.model.norm", "thinker.model.norm"):
        module = model
        try:
            for part in path.split("."):
                module = getattr(module, part)
        except AttributeError:
            continue
        return module
    raise RuntimeError(f"no final norm found on {type(model).__name__} to read hidden states")


class HiddenStatesMixin:
    """Mixed into vLLM's worker class for this platform (see `worker_class_path`)."""

    def _omni_setup(self) -> None:
        self._omni_rows: dict[str, list[torch.Tensor]] = {}
        self._omni_keys: dict[str, str] = {}  # vLLM request id -> caller's key
        self._omni_step: torch.Tensor | None = None
        self._omni_connector = SharedMemoryConnector(prefix="omni-hs")

        def hook(_module, _inputs, output):
            out = output[0] if isinstance(output, tuple) else output
            self._omni_step = out.detach()

        _final_norm(self.model_runner.get_model()).register_forward_hook(hook)

    def execute_model(self, scheduler_output: Any):
        if not hasattr(self, "_omni_rows"):
            self._omni_setup()
        for req in scheduler_output.scheduled_new_reqs:
            extra = (req.sampling_params.extra_args or {}) if req.sampling_params else {}
            if REQUEST_KEY in extra:
                self._omni_keys[req.req_id] = str(extra[REQUEST_KEY])
                self._omni_rows.setdefault(self._omni_keys[req.req_id], [])
        self._omni_step = None
        output = super().execute_model(scheduler_output)
        step, self._omni_step = self._omni_step, None
        if step is not None and self._omni_keys:
            start = 0
            counts = scheduler_output.num_scheduled_tokens
            for req_id in self.model_runner.input_batch.req_ids:
                n = counts.get(req_id, 0)
                if req_id in self._omni_keys and n:
                    key = self._omni_keys[req_id]
                    self._omni_rows[key].append(step[start : start + n].to("cpu", copy=True))
                start += n
        for req_id in scheduler_output.finished_req_ids:
            self._omni_keys.pop(req_id, None)
        return output

    def take_hidden_states(self, key: str) -> dict[str, Any] | None:
        """Move a finished request's rows to shared memory; returns the handle as plain data
        (it crosses vLLM's RPC encoding), or None if this worker holds none."""
        rows = getattr(self, "_omni_rows", {}).pop(key, None)
        if not rows:
            return None
        handle = self._omni_connector.put({"hidden_states": torch.cat(rows)})
        return {
            "segment": handle.segment,
            "size": handle.size,
            "tensors": [
                [t.name, t.dtype, list(t.shape), t.offset, t.nbytes] for t in handle.tensors
            ],
        }

    def drop_hidden_states(self, key: str) -> None:
        """Forget rows nobody will take (an aborted request)."""
        getattr(self, "_omni_rows", {}).pop(key, None)


def handle_from_rpc(data: dict[str, Any]) -> ShmHandle:
    return ShmHandle(
        data["segment"],
        data["size"],
        tuple(TensorLayout(n, d, tuple(s), o, b) for n, d, s, o, b in data["tensors"]),
    )


def worker_class_path() -> str:
    """The `worker_cls` engine arg for this platform."""
    return f"{__name__}.{'CPU' if current_platform.is_cpu() else 'GPU'}HiddenStatesWorker"


def __getattr__(name: str):
    # Built lazily: importing a platform's worker module pulls in its whole runtime.
    if name == "CPUHiddenStatesWorker":
        from vllm.v1.worker.cpu_worker import CPUWorker

        return type(name, (HiddenStatesMixin, CPUWorker), {"__module__": __name__})
    if name == "GPUHiddenStatesWorker":
        from vllm.v1.worker.gpu_worker import Worker

        return type(name, (HiddenStatesMixin, Worker), {"__module__": __name__})
    raise AttributeError(name)
