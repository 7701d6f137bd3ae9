"""A code2wav stage: codec tokens in (from its input processor), audio out."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import AsyncIterator
from typing import Any, ClassVar

import numpy as np
import torch

from vllm_omni.config.kinds import Capability
from vllm_omni.config.schema import StageConfig
from vllm_omni.engine.code2wav.core import Code2WavCore, Code2WavOptions, check_params
from vllm_omni.engine.memory import RUNTIME, TORCH_BYTES, StagePlan, weights_bytes
from vllm_omni.engine.runtime import EngineClient
from vllm_omni.engine.stage import EngineStage, StageInfo, StartContext
from vllm_omni.outputs import AudioOutput, OmniRequestOutput

logger = logging.getLogger(__name__)


def code2wav_options(config: StageConfig) -> Code2WavOptions:
    """Options from the stage's YAML `engine_args`, its placement's device and defaults."""
    options = dict(config.engine_args)
    if config.placement is not None:
        options.setdefault("device", config.placement.device)
    options["defaults"] = {**config.sampling_params, **options.get("defaults", {})}
    return Code2WavOptions(**options)


_OPTION_NAMES = {f.name for f in dataclasses.fields(Code2WavOptions)}


class GrowingWaveform:
    """A request's waveform so far, grown in place (its room doubles when full), so each
    chunk copies only its own samples. The views it hands out stay valid: later samples
    are written past their end."""

    def __init__(self) -> None:
        self.buffer = np.empty(0, np.float32)
        self.size = 0

    def extend(self, piece: np.ndarray) -> np.ndarray:
        end = self.size + len(piece)
        if end > len(self.buffer):
            grown = np.empty(max(end, 2 * len(self.buffer)), piece.dtype)
            grown[:self.size] = self.buffer[:self.size]
            self.buffer = grown
        self.buffer[self.size:end] = piece
        self.size = end
        return self.buffer[:end]


class Code2WavStage(EngineStage):
    """A stage that voices codec tokens (Qwen2.5-Omni's token2wav), whole or as they come."""

    outputs: ClassVar[frozenset[str]] = frozenset({"audio"})
    capabilities: ClassVar[frozenset[str]] = frozenset({Capability.STREAMED_INPUT})

    # -- the kind ------------------------------------------------------------------------

    @classmethod
    def check_engine_args(cls, args: dict[str, Any]) -> None:
        unknown = sorted(set(args) - _OPTION_NAMES)
        if unknown:
            raise ValueError(f"unknown code2wav engine options {unknown}")

    @classmethod
    def check_sampling_params(cls, params: dict[str, Any]) -> None:
        check_params(params, speakers=None)  # the model's voices are known at start-up

    @classmethod
    def memory_needs(cls, config: StageConfig, context: StartContext, device: str) -> StagePlan:
        """Its weights (fp32, as HF runs it) and a batch of mel frames through the DiT and
        the vocoder (an estimate: 64 KiB per frame)."""
        options = code2wav_options(config)
        prefix = config.weights_prefix or "token2wav."
        return StagePlan(
            stage=config.name, engine=config.engine, device=device,
            weights=weights_bytes(config.model or context.model, prefix,
                                  TORCH_BYTES.get(options.dtype, 4)),
            kv_cache=0, activations=options.max_batch_frames * 64 * 1024,
            runtime=int(RUNTIME[("other", device[:4])]),
        )

    @classmethod
    def start(cls, config: StageConfig, context: StartContext) -> Code2WavStage:
        return cls(config, context)

    # -- the stage -----------------------------------------------------------------------

    def __init__(self, config: StageConfig, context: StartContext) -> None:
        self.config = config
        self.name = config.name
        self.engine = EngineClient(Code2WavCore, config.model or context.model,
                                   code2wav_options(config))
        facts = self.engine.info
        self.info = StageInfo(
            name=config.name, engine=config.engine, output=config.output,
            defaults=dict(facts.get("defaults") or {}), inputs=("codes",),
            voices=tuple(facts["speakers"]), sample_rate=facts["sample_rate"])
        self._codes: dict[str, list[int]] = {}  # per running request: its codes so far
        logger.info("stage %r serves %s", self.name, facts)

    @classmethod
    def request_params(cls, info: StageInfo, given: dict[str, Any] | None) -> dict[str, Any]:
        params = dict(given or {})
        check_params(params, list(info.voices))
        return params

    async def generate(
        self,
        request_id: str,
        prompt: dict[str, Any],
        params: dict[str, Any],
        *,
        input_complete: bool = True,
        keep_hidden_states: bool = False,
    ) -> AsyncIterator[OmniRequestOutput]:
        """`prompt`: {"codes": [...], "speaker": optional voice} (see the input processor).
        With `input_complete` false, more codes follow through `add_input`.

        Each output's `audio` is the waveform so far (streamed requests get one output per
        chunk; `metrics["new_samples"]` says how many samples it added)."""
        params = {**params}
        if prompt.get("speaker") is not None:
            params.setdefault("speaker", prompt["speaker"])
        codes = self._codes[request_id] = list(prompt["codes"])
        so_far = GrowingWaveform()
        try:
            async for out in self.engine.generate(
                request_id, {"codes": codes, "complete": input_complete}, params
            ):
                waveform = so_far.extend(out.waveform)
                yield OmniRequestOutput(
                    request_id=request_id,
                    stage=self.name,
                    output_type="audio",
                    finished=out.finished,
                    audio=AudioOutput(waveform, out.sample_rate),
                    tensors={"codes": torch.tensor(self._codes[request_id], dtype=torch.long)}
                    if out.finished else {},
                    metrics={"seed": out.seed, "input_complete": out.input_complete,
                             "new_samples": len(out.waveform), "samples": len(waveform)},
                )
        finally:
            self._codes.pop(request_id, None)

    async def add_input(self, request_id: str, prompt: dict[str, Any], complete: bool) -> None:
        """The request's codes so far (the input processor's prompt for the upstream output
        so far); only the new ones travel."""
        sent = self._codes.get(request_id)
        if sent is None:
            return  # finished, failed or aborted meanwhile
        codes = list(prompt["codes"])
        if codes[: len(sent)] != sent:
            raise ValueError(f"streamed codes of {request_id!r} are not a continuation of "
                             "the ones already sent")
        self._codes[request_id] = codes
        await self.engine.extend(request_id, {"codes": codes[len(sent):], "complete": complete})
