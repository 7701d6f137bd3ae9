"""Per-request, per-position inputs into an AR stage's model, through `worker_cls`.

Some stages read more than token ids at every step: Qwen2.5-Omni's talker adds the thinker's
state for the position it is at. A request asks for it with
`SamplingParams.extra_args["omni_step_inputs"]` = {"tensors": a shared-memory handle (as plain
data) of the upstream tensors, "args": plain values}. When the request arrives, the worker
reads the tensors and lets the model turn them into its table
(`model.step_table(tensors, **args)`, e.g. talker.StepTable: `rows` per position and
`use_codec(positions)`, where the token's own embedding counts); during each forward
pass the model asks for the rows of the step's tokens (`model.step_inputs(positions)`), which
the worker gathers request by request in the model runner's token layout. A model whose
inputs depend on more than the position (Qwen3-Omni's talker: the codes it wrote the step
before) asks instead for the step's segments (`model.step_segments()`: per request with
tokens in the step, its table, or None, and its tokens' start and count) and reads its
tables itself.

Every rank of a tensor-parallel stage runs the model, so each reads the tensors; none
releases them: the stage discards the payload once the request is over.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from vllm_omni.transfer.connectors import SharedMemoryConnector, ShmHandle

REQUEST_KEY = "omni_step_inputs"

logger = logging.getLogger(__name__)


class StepInputsMixin:
    """Mixed into vLLM's worker class for this platform; inert for models without
    `step_table` and for requests that bring no step inputs."""

    def _step_setup(self) -> None:
        self._step_tables: dict[str, Any] = {}
        self._step_scheduled: Any = None
        self._step_model = self.model_runner.get_model()
        if hasattr(self._step_model, "step_table"):
            self._step_model.step_inputs = self._step_rows
            self._step_model.step_segments = self._step_segments

    def execute_model(self, scheduler_output: Any):
        if not hasattr(self, "_step_tables"):
            self._step_setup()
        for req in scheduler_output.scheduled_new_reqs:
            extra = (req.sampling_params.extra_args or {}) if req.sampling_params else {}
            if REQUEST_KEY in extra:
                if not hasattr(self._step_model, "step_table"):
                    raise ValueError(
                        f"{type(self._step_model).__name__} takes no per-step inputs"
                    )
                given = extra[REQUEST_KEY]
                try:
                    tensors = SharedMemoryConnector().get(
                        ShmHandle.from_data(given["tensors"]), release=False)
                except FileNotFoundError:  # discarded: the request was aborted meanwhile
                    logger.warning("step inputs of %s are gone; it runs without", req.req_id)
                    continue
                self._step_tables[req.req_id] = self._step_model.step_table(
                    tensors, **given.get("args", {})
                )
        self._step_scheduled = scheduler_output
        try:
            return super().execute_model(scheduler_output)
        finally:
            self._step_scheduled = None
            for req_id in scheduler_output.finished_req_ids:
                self._step_tables.pop(req_id, None)

    def _step_rows(self, positions: torch.Tensor):
        """Per token of this step: (the upstream part, 1 where the token's own embedding
        counts, its (3,) RoPE position); None outside a scheduled step (warm-up and profiling
        runs). Tokens of requests without step inputs get zeros, 1 and their index."""
        scheduled = self._step_scheduled
        if scheduled is None or not self._step_tables:
            return None
        tables = self._step_tables
        some = next(iter(tables.values())).rows
        part = torch.zeros(len(positions), some.shape[1], dtype=some.dtype,
                           device=positions.device)
        use_token = torch.ones(len(positions), 1, dtype=part.dtype, device=positions.device)
        rope = positions.expand(3, -1).clone()
        start = 0
        for req_id in self.model_runner.input_batch.req_ids:
            n = scheduled.num_scheduled_tokens.get(req_id, 0)
            table = tables.get(req_id)
            if table is not None and n:
                pos = positions[start : start + n]
                part[start : start + n] = table.rows[pos.clamp(max=len(table.rows) - 1)]
                use_token[start : start + n, 0] = table.use_codec(pos).to(part.dtype)
                rope[:, start : start + n] = table.rope_positions(pos)
            start += n
        return part, use_token[:, 0], rope

    def _step_segments(self) -> list[tuple[Any, int, int]] | None:
        """Per request with tokens in this step, in the model runner's token layout: (its
        table, or None without step inputs, the index of its first token, its token count);
        None outside a scheduled step."""
        scheduled = self._step_scheduled
        if scheduled is None:
            return None
        segments, start = [], 0
        for req_id in self.model_runner.input_batch.req_ids:
            n = scheduled.num_scheduled_tokens.get(req_id, 0)
            if n:
                segments.append((self._step_tables.get(req_id), start, n))
            start += n
        return segments
