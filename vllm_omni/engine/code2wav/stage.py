"""A code2wav stage: codec tokens in (from its input processor), audio out."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

import torch

from vllm_omni.config.schema import StageConfig
from vllm_omni.engine.code2wav.core import Code2WavOptions, check_params, run_code2wav_core
from vllm_omni.engine.diffusion.client import AsyncDiffusionEngine
from vllm_omni.engine.stage import EngineStage
from vllm_omni.outputs import AudioOutput, OmniRequestOutput

logger = logging.getLogger(__name__)


class Code2WavStage(EngineStage):
    def __init__(self, config: StageConfig, model: str) -> None:
        self.config = config
        self.name = config.name
        options = dict(config.engine_args)
        if config.placement is not None:
            options.setdefault("device", config.placement.device)
        options["defaults"] = {**config.sampling_params, **options.get("defaults", {})}
        self.engine = AsyncDiffusionEngine(
            config.model or model, Code2WavOptions(**options), run_code2wav_core,
            "Code2WavEngineCore",
        )
        self.sample_rate: int = self.engine.info["sample_rate"]
        self.speakers: list[str] = self.engine.info["speakers"]
        logger.info("stage %r serves %s", self.name, self.engine.info)

    def sampling_params(self, given: dict[str, Any] | None) -> dict[str, Any]:
        params = dict(given or {})
        check_params(params, self.speakers)
        return params

    async def render(self, prompts: list[Any]) -> list[Any]:
        return list(prompts)

    async def generate(
        self, request_id: str, prompt: dict[str, Any], params: dict[str, Any]
    ) -> AsyncIterator[OmniRequestOutput]:
        """`prompt`: {"codes": [...], "speaker": optional voice} (see the input processor)."""
        params = {**params}
        if prompt.get("speaker") is not None:
            params.setdefault("speaker", prompt["speaker"])
        async for out in self.engine.generate(request_id, list(prompt["codes"]), params):
            yield OmniRequestOutput(
                request_id=request_id,
                stage=self.name,
                output_type="audio",
                finished=out.finished,
                audio=AudioOutput(out.waveform, out.sample_rate),
                tensors={"codes": torch.tensor(prompt["codes"], dtype=torch.long)},
                metrics={"seed": out.seed},
            )
