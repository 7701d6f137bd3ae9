"""What the served pipeline can do, for clients that adapt to it (the playground): read from
the stages' `StageInfo`, so it is the same wherever the stages run."""

from __future__ import annotations

from typing import Any

from vllm_omni.entrypoints.async_omni_llm import AsyncOmniLLM


def pipeline_info(omni: AsyncOmniLLM, served_model_names: list[str]) -> dict[str, Any]:
    finals = [s for s in omni.order if s.final_output]
    image, audio, text = omni.image_stage, omni.audio_stage, omni.text_stage
    video = omni.video_stage
    return {
        "model": served_model_names[0],
        "pipeline": omni.pipeline.name,
        "stages": [{"name": s.name, "engine": s.engine, "output": s.output,
                    "inputs": s.inputs, "final_output": s.final_output,
                    "max_running": omni.stages[s.name].info.max_running} for s in omni.order],
        "outputs": sorted({s.output for s in finals}),
        "default_modalities": omni.pipeline.default_modalities,
        "inputs": list(text.info.inputs) if text else ["text"],
        "max_model_len": text.info.max_model_len if text else None,
        "image": image and {
            "stage": image.name, "edits": image.info.takes_images,
            "family": image.info.family, "step_level": image.info.step_level,
            "defaults": image.info.defaults,
        },
        "video": video and {
            "stage": video.name, "family": video.info.family,
            "from_image": video.info.takes_images, "defaults": video.info.defaults,
        },
        "audio": audio and {"stage": audio.name, "voices": list(audio.info.voices),
                            "sample_rate": audio.info.sample_rate},
    }
