"""Hidden states out of an AR stage, through vLLM's `worker_cls` extension point.

The worker (vllm_omni.engine.ar.worker) hooks the model's final norm and the input of its
first decoder layer, splits each step's rows by request (the model runner lays a step's tokens
out request by request, in input-batch order), and keeps the rows of requests that asked for
them (`SamplingParams.extra_args["omni_hidden_states"]` = a key). Prompt rows come first, then
one row per decode step: the layout of HF's `hidden_states`, where the last sampled token has
no row yet. Two tensors per request: `hidden_states` (after the final norm, HF's
`hidden_states[-1]`) and `embeds` (the decoder's input embeddings, multimodal ones merged in:
HF's `hidden_states[0]`). Models with multimodal RoPE add `positions`, the prompt's (3, P)
positions, and `position_delta`, the offset of every later position (vLLM's own).

When the request is done the orchestrator calls `take_hidden_states(key)` over
`collective_rpc`; the worker writes the rows to shared memory and returns only a small
handle, so the tensors never pass through the engine core or the API process.

Under tensor parallelism every rank sees the same rows (the embeddings and the final norm's
output are all-reduced, whole on each rank), so only the group's first rank keeps them: one
copy, one handle.
"""

from __future__ import annotations

from typing import Any

import torch

from vllm_omni.transfer.connectors import SharedMemoryConnector

REQUEST_KEY = "omni_hidden_states"
# Shared memory each worker keeps for the rows it hands on, reused request after request.
POOL_BYTES = 256 << 20


def _decoder(model: torch.nn.Module) -> torch.nn.Module:
    """The module that holds the model's decoder layers and final norm."""
    for path in ("model", "language_model.model", "thinker.model", "thinker.language_model.model"):
        module = model
        try:
            for part in path.split("."):
                module = getattr(module, part)
        except AttributeError:
            continue
        if hasattr(module, "norm") and hasattr(module, "layers"):
            return module
    raise RuntimeError(f"no decoder layers found on {type(model).__name__} to read states from")


class HiddenStatesMixin:
    """Mixed into vLLM's worker class for this platform."""

    def _hidden_setup(self) -> None:
        self._omni_rows: dict[str, dict[str, list[torch.Tensor]]] = {}
        self._omni_keys: dict[str, str] = {}  # vLLM request id -> caller's key
        self._omni_step: dict[str, torch.Tensor] = {}
        self._omni_connector = SharedMemoryConnector(prefix="omni-hs", pool_bytes=POOL_BYTES)
        from vllm.distributed import get_tensor_model_parallel_rank

        self._omni_keeps = get_tensor_model_parallel_rank() == 0
        if not self._omni_keeps:
            return
        decoder = _decoder(self.model_runner.get_model())

        def after_norm(_module, _inputs, output):
            out = output[0] if isinstance(output, tuple) else output
            self._omni_step["hidden_states"] = out.detach()

        def before_first_layer(_module, args, kwargs):
            embeds = kwargs["hidden_states"] if "hidden_states" in kwargs else args[1]
            self._omni_step["embeds"] = embeds.detach()

        decoder.norm.register_forward_hook(after_norm)
        decoder.layers[0].register_forward_pre_hook(before_first_layer, with_kwargs=True)

    def execute_model(self, scheduler_output: Any):
        if not hasattr(self, "_omni_rows"):
            self._hidden_setup()
        if not self._omni_keeps:
            return super().execute_model(scheduler_output)
        for req in scheduler_output.scheduled_new_reqs:
            extra = (req.sampling_params.extra_args or {}) if req.sampling_params else {}
            if REQUEST_KEY in extra:
                self._omni_keys[req.req_id] = str(extra[REQUEST_KEY])
                self._omni_rows.setdefault(self._omni_keys[req.req_id], {})
        self._omni_step = {}
        output = super().execute_model(scheduler_output)
        step, self._omni_step = self._omni_step, {}
        if step and self._omni_keys:
            start = 0
            counts = scheduler_output.num_scheduled_tokens
            for req_id in self.model_runner.input_batch.req_ids:
                n = counts.get(req_id, 0)
                if req_id in self._omni_keys and n:
                    rows = self._omni_rows[self._omni_keys[req_id]]
                    for name, tensor in step.items():
                        rows.setdefault(name, []).append(
                            tensor[start : start + n].to("cpu", copy=True)
                        )
                start += n
        for req in scheduler_output.scheduled_new_reqs:
            state = self.model_runner.requests.get(req.req_id)
            positions = getattr(state, "mrope_positions", None)
            if req.req_id in self._omni_keys and positions is not None:
                rows = self._omni_rows[self._omni_keys[req.req_id]]
                rows["positions"] = [positions.to("cpu", copy=True)]
                rows["position_delta"] = [torch.tensor([state.mrope_position_delta])]
        for req_id in scheduler_output.finished_req_ids:
            self._omni_keys.pop(req_id, None)
        return output

    def take_hidden_states(self, key: str) -> dict[str, Any] | None:
        """Move a finished request's rows to shared memory; returns the handle as plain data
        (it crosses vLLM's RPC encoding), or None if this worker holds none."""
        rows = getattr(self, "_omni_rows", {}).pop(key, None)
        if not rows:
            return None
        # Rows per step are stacked along tokens; positions are (3, P), the delta one value.
        handle = self._omni_connector.put({
            name: r[0] if name in ("positions", "position_delta") else torch.cat(r)
            for name, r in rows.items()
        })
        return handle.as_data()

    def drop_hidden_states(self, key: str) -> None:
        """Forget rows nobody will take (an aborted request)."""
        getattr(self, "_omni_rows", {}).pop(key, None)
