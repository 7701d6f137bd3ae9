"""Hidden states out of an AR stage, through vLLM's `worker_cls` extension point.

The worker (vllm_omni.engine.ar.worker) hooks the call of the model vLLM runs (its top-level
module, which vLLM does not compile: the decoder inside it is compiled, so hooks there would
never run): the input embeddings going in (multimodal ones merged in by the model runner; for
text-only models the hook looks the token ids up) and the final norm's output coming out.
Each step's rows are split by request (the model runner lays a step's tokens out request by
request, in input-batch order) and kept for requests that asked for them
(`SamplingParams.extra_args["omni_hidden_states"]` = a key). Prompt rows come first, then one
row per decode step: the layout of HF's `hidden_states`, where the last sampled token has no
row yet. Two tensors per request: `hidden_states` (HF's `hidden_states[-1]`) and `embeds`
(HF's `hidden_states[0]`). Models with multimodal RoPE add `positions`, the prompt's (3, P)
positions, and `position_delta`, the offset of every later position (vLLM's own). A model
can offer more rows per token (`omni_row_names`, set as `omni_rows` by its forward: Qwen3-Omni's
thinker hands on the intermediate layer its talker reads); they are kept the same way.

With prefix caching on, a request that hits the cache skips the forward pass over the cached
tokens. Their rows are kept with the cache: every computed token's rows go to a store indexed
like the KV cache (block id x block size + offset), so a block's rows are exactly as old as
its KV; a request starting after cached tokens copies their rows from the store. The store is
an empty tensor: its pages take memory only as blocks are first used, at most the KV cache's
token count times the two rows.

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
ROWS = ("embeds", "hidden_states")


class RowStore:
    """The rows of every token whose KV is cached, at the slot its KV occupies."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.num_slots = num_blocks * block_size
        self.tensors: dict[str, torch.Tensor] = {}

    def slots(self, block_ids: list[int], start: int, stop: int) -> torch.Tensor:
        index = torch.arange(start, stop)
        blocks = torch.tensor(block_ids, dtype=torch.long)[index // self.block_size]
        return blocks * self.block_size + index % self.block_size

    def write(self, name: str, slots: torch.Tensor, rows: torch.Tensor) -> None:
        store = self.tensors.get(name)
        if store is None:
            store = self.tensors[name] = torch.empty(self.num_slots, rows.shape[1],
                                                     dtype=rows.dtype)
        store[slots] = rows

    def read(self, name: str, slots: torch.Tensor) -> torch.Tensor:
        return self.tensors[name][slots]


class RequestRows:
    """One request's rows, token by token from its first prompt token."""

    def __init__(self) -> None:
        self.chunks: dict[str, list[torch.Tensor]] = {}
        self.count = 0
        self.extra: dict[str, torch.Tensor] = {}

    def put(self, start: int, rows: dict[str, torch.Tensor]) -> None:
        """Rows of tokens `start...`; a start before the end (a preempted request computed
        again) replaces what follows it."""
        if start < self.count:
            self.chunks = {name: [torch.cat(c)[:start]] for name, c in self.chunks.items()}
        for name, tensor in rows.items():
            self.chunks.setdefault(name, []).append(tensor)
        self.count = start + len(next(iter(rows.values())))

    def tensors(self) -> dict[str, torch.Tensor]:
        return {**{name: torch.cat(c) for name, c in self.chunks.items()}, **self.extra}


def step_starts(scheduler_output: Any) -> dict[str, int]:
    """Request id -> index of the first token it computes in this step."""
    starts = {r.req_id: r.num_computed_tokens for r in scheduler_output.scheduled_new_reqs}
    cached = scheduler_output.scheduled_cached_reqs
    starts.update(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
    return starts


class HiddenStatesMixin:
    """Mixed into vLLM's worker class for this platform."""

    def _hidden_setup(self) -> None:
        self._omni_rows: dict[str, RequestRows] = {}
        self._omni_keys: dict[str, str] = {}  # vLLM request id -> caller's key
        self._omni_step: dict[str, torch.Tensor] = {}
        self._omni_capture = False
        self._omni_store: RowStore | None = None
        self._omni_connector = SharedMemoryConnector(prefix="omni-hs", pool_bytes=POOL_BYTES)
        from vllm.distributed import get_tensor_model_parallel_rank
        from vllm.forward_context import get_forward_context

        # Every rank runs the hooks: looking token ids up is a collective under tensor
        # parallelism. Only the first rank keeps what they capture.
        self._omni_keeps = get_tensor_model_parallel_rank() == 0
        self._omni_prefix_cache = self.vllm_config.cache_config.enable_prefix_caching
        if self._omni_keeps and self._omni_prefix_cache:
            kv = self.model_runner.kv_cache_config
            self._omni_store = RowStore(
                kv.num_blocks, kv.kv_cache_groups[0].kv_cache_spec.block_size)
        model = self.model_runner.get_model()
        self._omni_row_names = ROWS + tuple(getattr(model, "omni_row_names", ()))

        def before(module, args, kwargs):
            if not self._omni_capture:
                return
            embeds = kwargs.get("inputs_embeds")
            if embeds is None:
                embeds = module.embed_input_ids(kwargs.get("input_ids", args[0] if args else None))
            self._omni_step["embeds"] = embeds.detach()

        def after(_module, _args, output):
            if self._omni_capture:
                out = output[0] if isinstance(output, tuple) else output
                self._omni_step["hidden_states"] = out.detach()
                for name, rows in getattr(_module, "omni_rows", {}).items():
                    self._omni_step[name] = rows.detach()
                # Where each of the step's tokens has its KV: where the store files its rows.
                mapping = get_forward_context().slot_mapping
                if isinstance(mapping, dict) and mapping:
                    self._omni_step["slots"] = next(iter(mapping.values())).detach()

        model.register_forward_pre_hook(before, with_kwargs=True)
        model.register_forward_hook(after)

    def execute_model(self, scheduler_output: Any):
        if not hasattr(self, "_omni_rows"):
            self._hidden_setup()
        for req in scheduler_output.scheduled_new_reqs:
            extra = (req.sampling_params.extra_args or {}) if req.sampling_params else {}
            if REQUEST_KEY in extra:
                self._omni_keys[req.req_id] = str(extra[REQUEST_KEY])
                if self._omni_keeps:
                    self._omni_rows.setdefault(self._omni_keys[req.req_id], RequestRows())
        starts = step_starts(scheduler_output)
        self._omni_step = {}
        self._omni_capture = bool(self._omni_keys) or self._omni_prefix_cache
        try:
            output = super().execute_model(scheduler_output)
        finally:
            self._omni_capture = False
        step, self._omni_step = self._omni_step, {}
        if self._omni_keeps:
            if all(name in step for name in self._omni_row_names):
                self._keep_step(step, scheduler_output.num_scheduled_tokens, starts)
            for req in scheduler_output.scheduled_new_reqs:
                state = self.model_runner.requests.get(req.req_id)
                positions = getattr(state, "mrope_positions", None)
                if req.req_id in self._omni_keys and positions is not None:
                    self._omni_rows[self._omni_keys[req.req_id]].extra = {
                        "positions": positions.to("cpu", copy=True),
                        "position_delta": torch.tensor([state.mrope_position_delta]),
                    }
        for req_id in scheduler_output.finished_req_ids:
            self._omni_keys.pop(req_id, None)
        return output

    def _keep_step(self, step: dict[str, torch.Tensor], counts: dict[str, int],
                   starts: dict[str, int]) -> None:
        """File the step's rows: into the store, and for each request that asked for them."""
        total = sum(counts.values())
        on_cpu = {name: step[name][:total].to("cpu", copy=True) for name in self._omni_row_names}
        store = self._omni_store
        if store is not None:
            if "slots" not in step:
                raise RuntimeError("the model runner gave no KV slots for the step's tokens")
            slots = step["slots"][:total].to("cpu", torch.long)
            for name, rows in on_cpu.items():
                store.write(name, slots, rows)
        offset = 0
        for req_id in self.model_runner.input_batch.req_ids:
            n = counts.get(req_id, 0)
            key = self._omni_keys.get(req_id) if n else None
            if key is not None:
                kept, start = self._omni_rows[key], starts[req_id]
                if start > kept.count:  # the tokens before this step came from the cache
                    if store is None:
                        raise RuntimeError(f"request {req_id} starts at token {start} without "
                                           "a prefix cache to take the rows before it from")
                    block_ids = self.model_runner.requests[req_id].block_ids[0]
                    cached = store.slots(block_ids, kept.count, start)
                    kept.put(kept.count, {name: store.read(name, cached)
                                          for name in self._omni_row_names})
                kept.put(start, {name: rows[offset : offset + n].clone()
                                 for name, rows in on_cpu.items()})
            offset += n

    def take_hidden_states(self, key: str) -> dict[str, Any] | None:
        """Move a finished request's rows to shared memory; returns the handle as plain data
        (it crosses vLLM's RPC encoding), or None if this worker holds none."""
        rows = getattr(self, "_omni_rows", {}).pop(key, None)
        if rows is None or not rows.count:
            return None
        return self._omni_connector.put(rows.tensors()).as_data()

    def drop_hidden_states(self, key: str) -> None:
        """Forget rows nobody will take (an aborted request)."""
        getattr(self, "_omni_rows", {}).pop(key, None)
