"""Step caching for a batch of independent requests: per-row decisions, per-request state.

Each transformer block of the pipeline gets one diffusers hook (`diffusers.hooks`), so the
blocks stay in their lists, with their own attributes and state-dict keys. While a step runs,
every row of the batch (one image of one request in one guidance branch) has its own
`CacheSlot`; at the row's first cacheable block the slot decides whether to reuse, and from
there to the end of its span the row is left out of the block calls (the rows that compute
run as a smaller batch). At the end of the span a reused row gets its input plus the cached
(or forecast) residual; a computed row stores its new residual. Rows without a slot always
compute, so requests with different settings, or none, share one batched call.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from diffusers.hooks import HookRegistry, ModelHook
from torch import nn

from vllm_omni.engine.diffusion.cache.config import CacheConfig

# Block keyword arguments with one row per image; the rest (rotary tables, kwargs dicts) are
# shared by the whole batch.
_BATCHED = ("hidden_states", "encoder_hidden_states", "temb", "encoder_hidden_states_mask")
_BLOCK_LISTS = ("transformer_blocks", "single_transformer_blocks", "blocks")
# Lists whose blocks take the text as a condition and return only the image (video) stream
# (Wan); the others return (text, image) streams.
_SINGLE_STREAM = ("blocks",)
HOOK_NAME = "vllm_omni_step_cache"


class CacheSlot:
    """The cache state of one row: one image of one request in one guidance branch."""

    def __init__(self, config: CacheConfig, key: tuple = ()) -> None:
        self.config = config
        # (request id, index): names the slot on every rank of a parallel stage.
        self.key = key
        self.computed = 0
        self.cached = 0
        self._consecutive = 0
        self._signal: torch.Tensor | None = None  # teacache: previous step's; block: last computed
        self._accumulated = 0.0
        # (timestep, hidden residual, encoder residual) of the last two computed steps.
        self._history: list[tuple[float, torch.Tensor, torch.Tensor | None]] = []

    def span(self, num_blocks: int) -> tuple[int, int]:
        """The blocks [start, end) this slot may skip."""
        if self.config.method == "teacache":
            return 0, num_blocks
        return self.config.first_blocks, num_blocks - self.config.last_blocks

    def measure(self, signal: torch.Tensor) -> torch.Tensor | None:
        """The sums whose ratio is the signal's relative L1 change since the slot's last
        signal (None at first): kept as sums so slices of one sequence can be added up."""
        if self._signal is None:
            return None
        return torch.stack([(signal - self._signal).abs().sum(), self._signal.abs().sum()])

    def decide(self, signal: torch.Tensor, change: float | None = None) -> bool:
        """True to reuse the cached residual at this step; called once per step with the
        relative change from `measure`'s sums (added up over the ranks where the sequence
        is split); measured here when not given."""
        c = self.config
        if change is None and self._signal is not None:
            total, base = self.measure(signal).tolist()
            change = total / base
        step = self.computed + self.cached
        forced = (
            not self._history
            or change is None
            or step < c.warmup_steps
            or self._consecutive >= c.max_consecutive
            or (c.max_cached is not None and self.cached >= c.max_cached)
        )
        if c.method == "teacache":
            self._signal = signal
            if change is not None:
                self._accumulated += c.rescale(change)
            reuse = not forced and self._accumulated < c.threshold
        else:
            reuse = not forced and change < c.threshold
        self.count(reuse)
        if not reuse:
            self._consecutive = 0
            self._accumulated = 0.0
            if c.method == "block":
                self._signal = signal
        return reuse

    def count(self, reused: bool) -> None:
        """Count one step (also for a row another rank decided: the request's stats)."""
        if reused:
            self.cached += 1
            self._consecutive += 1
        else:
            self.computed += 1

    def store(self, t: float, hidden: torch.Tensor, encoder: torch.Tensor | None) -> None:
        self._history = [*self._history[-1:], (t, hidden, encoder)]

    def residual(self, t: float) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The residual to reuse at timestep t: the last one, or its first-order forecast."""
        t1, h1, e1 = self._history[-1]
        if not self.config.taylor or len(self._history) < 2 or self._history[0][0] == t1:
            return h1, e1
        t0, h0, e0 = self._history[0]
        k = (t - t1) / (t1 - t0)
        e = None
        if e1 is not None and e0 is not None:
            n = min(len(e0), len(e1))  # text padded to other lengths in other batches
            e = e1[:n] + k * (e1[:n] - e0[:n])
        return h1 + k * (h1 - h0), e


@dataclass
class _Step:
    """The rows of one transformer call and what each decided."""

    slots: list[CacheSlot | None]
    timesteps: list[float]
    spans: list[tuple[int, int]]
    reuse: list[bool] = field(default_factory=list)
    first_input: torch.Tensor | None = None
    span_inputs: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = field(default_factory=dict)


class _StepCacheHook(ModelHook):
    """Sends one block's calls through its manager, which may skip rows or the whole call."""

    def __init__(self, index: int, manager: DiTCacheManager) -> None:
        super().__init__()
        self.index = index
        self.manager = manager
        self._signature: inspect.Signature | None = None

    def new_forward(self, module: nn.Module, *args: Any, **kwargs: Any) -> Any:
        if args:
            # The manager picks the per-row tensors by name. diffusers' transformers pass them
            # by keyword except under gradient checkpointing, which passes them by position.
            if self._signature is None:
                self._signature = inspect.signature(self.fn_ref.original_forward)
            kwargs = self._signature.bind(*args, **kwargs).arguments
        return self.manager.run(self.index, self.fn_ref.original_forward, kwargs)


ModulatedInput = Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]


class DiTCacheManager:
    """Hooks a transformer's blocks so each transformer call can skip them row by row.

    `unsupported` says why a transformer cannot be cached (None when it can).
    """

    def __init__(self, transformer: nn.Module, modulated_input: ModulatedInput) -> None:
        self.modulated_input = modulated_input
        self._blocks: list[nn.Module] = []
        self._single: set[int] = set()  # indices of single-stream blocks
        self._active: _Step | None = None
        # Sums the rows' change statistics over the ranks that hold slices of one sequence,
        # so they all decide alike (None: one process holds the whole sequence).
        self.reduce: Callable[[torch.Tensor], torch.Tensor] | None = None
        # Per-row state of others (LoRA adapters) narrowed to the rows a block computes,
        # while it runs on fewer rows than the call has.
        self.row_views: list[Callable[[list[int]], AbstractContextManager]] = []
        self.unsupported = self._why_not(transformer)
        if self.unsupported:
            return
        for name in _BLOCK_LISTS:
            for block in getattr(transformer, name, None) or []:
                registry = HookRegistry.check_if_exists_or_initialize(block)
                # A second adapter on the same pipeline takes the blocks over; two hooks
                # would both run the cache logic on one call.
                registry.remove_hook(HOOK_NAME, recurse=False)
                registry.register_hook(_StepCacheHook(len(self._blocks), self), HOOK_NAME)
                if name in _SINGLE_STREAM:
                    self._single.add(len(self._blocks))
                self._blocks.append(block)

    @property
    def num_blocks(self) -> int:
        return len(self._blocks)

    @staticmethod
    def _why_not(transformer: nn.Module) -> str | None:
        lists = [getattr(transformer, n, None) for n in _BLOCK_LISTS]
        if not any(isinstance(b, nn.ModuleList) and len(b) for b in lists):
            return f"{type(transformer).__name__} has no transformer block list to cache"
        if getattr(transformer.config, "zero_cond_t", False):
            return "its transformer modulates a second, zero-timestep condition in every row"
        return None

    def check(self, config: CacheConfig, model: str) -> None:
        """ValueError when `config` cannot apply to this model (a 400 when served)."""
        if not config.enabled:
            return
        if self.unsupported:
            raise ValueError(f"{model} cannot be cached: {self.unsupported}")
        start, end = CacheSlot(config).span(self.num_blocks)
        if start >= end:
            raise ValueError(
                f"first_blocks + last_blocks ({start} + {self.num_blocks - end}) leave no block "
                f"to skip: {model} has {self.num_blocks} transformer blocks"
            )

    @contextmanager
    def step(self, slots: list[CacheSlot | None], timesteps: list[float]) -> Iterator[None]:
        """Around one transformer call whose rows are `slots` (None: a row that never caches)."""
        if not any(slots):
            yield
            return
        never = (-1, -1)  # a row without a slot starts and ends no span
        spans = [s.span(self.num_blocks) if s else never for s in slots]
        self._active = _Step(slots, timesteps, spans, reuse=[False] * len(slots))
        try:
            yield
        finally:
            self._active = None

    def run(self, index: int, forward: Callable[..., Any], kwargs: dict[str, Any]) -> Any:
        """Block `index`'s call: `forward` (the block's own) on the rows that compute."""
        step = self._active
        if step is None:
            return forward(**kwargs)
        single = index in self._single
        # A single-stream block leaves the text as it is: only the image stream is cached.
        hidden = kwargs["hidden_states"]
        encoder = None if single else kwargs["encoder_hidden_states"]
        if index == 0:
            step.first_input = hidden
        starting = [r for r, (start, _) in enumerate(step.spans) if start == index]
        if starting:
            self._decide(step, starting, self._blocks[index], kwargs)
        skipped = [
            r for r, (start, end) in enumerate(step.spans)
            if step.reuse[r] and start <= index < end
        ]
        if not skipped:
            encoder_out, hidden_out = self._streams(forward(**kwargs), single)
        elif len(skipped) == len(step.slots):
            encoder_out, hidden_out = encoder, hidden
        else:
            encoder_out, hidden_out = self._run_rows(forward, kwargs, skipped, single)
        ending = [r for r, (_, end) in enumerate(step.spans) if end - 1 == index]
        if ending:
            encoder_out, hidden_out = self._end_span(step, ending, encoder_out, hidden_out)
        return hidden_out if single else (encoder_out, hidden_out)

    @staticmethod
    def _streams(out: Any, single: bool) -> tuple[torch.Tensor | None, torch.Tensor]:
        """(text, image) streams of a block's output."""
        return (None, out) if single else out

    def _decide(self, step: _Step, rows: list[int], block, kwargs) -> None:
        hidden, encoder = kwargs["hidden_states"], kwargs["encoder_hidden_states"]
        modulated = None
        signals, stats = [], []
        for r in rows:
            if step.slots[r].config.method == "teacache":
                if modulated is None:
                    modulated = self.modulated_input(block, hidden, kwargs["temb"])
                signal = modulated[r]
            else:
                signal = hidden[r] - step.first_input[r]
            signals.append(signal)
            stats.append(step.slots[r].measure(signal))
        measured = [m for m in stats if m is not None]
        changes = iter([])
        if measured:
            sums = torch.stack(measured).float()
            if self.reduce is not None:
                sums = self.reduce(sums)
            changes = iter((sums[:, 0] / sums[:, 1]).tolist())
        for r, signal, m in zip(rows, signals, stats, strict=True):
            change = None if m is None else next(changes)
            step.reuse[r] = step.slots[r].decide(signal, change)
            step.span_inputs[r] = (hidden[r], None if encoder is None else encoder[r])

    def _run_rows(self, forward, kwargs: dict, skipped: list[int], single: bool):
        """Run `forward` on the rows not skipped; skipped rows pass through unchanged."""
        hidden, encoder = kwargs["hidden_states"], kwargs["encoder_hidden_states"]
        rows = [r for r in range(hidden.shape[0]) if r not in skipped]
        keep = torch.tensor(rows, device=hidden.device)
        sub = {
            k: v.index_select(0, keep) if k in _BATCHED and isinstance(v, torch.Tensor) else v
            for k, v in kwargs.items()
        }
        with ExitStack() as views:
            for view in self.row_views:
                views.enter_context(view(rows))
            encoder_part, hidden_part = self._streams(forward(**sub), single)
        hidden_out = hidden.index_copy(0, keep, hidden_part)
        encoder_out = None if encoder_part is None else encoder.index_copy(0, keep, encoder_part)
        return encoder_out, hidden_out

    @staticmethod
    def _end_span(step: _Step, rows: list[int], encoder, hidden):
        reused = [r for r in rows if step.reuse[r]]
        if reused:  # written in place below: never into a tensor the caller still holds
            hidden = hidden.clone()
            encoder = None if encoder is None else encoder.clone()
        for r in rows:
            slot, t = step.slots[r], step.timesteps[r]
            h_in, e_in = step.span_inputs.pop(r)
            if step.reuse[r]:
                h_res, e_res = slot.residual(t)
                hidden[r] = h_in + h_res
                if encoder is not None and e_res is not None:
                    # A batch pads texts to its longest one (Qwen-Image), so the text stream
                    # may be longer or shorter than when the residual was stored; positions
                    # past the request's own text are masked padding either way.
                    n = min(len(e_res), encoder.shape[1])
                    encoder[r, :n] = e_in[:n] + e_res[:n]
            else:
                e_res = None if encoder is None or e_in is None else encoder[r] - e_in
                slot.store(t, hidden[r] - h_in, e_res)
        return encoder, hidden
