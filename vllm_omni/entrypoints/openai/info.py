"""What the served pipeline can do, for clients that adapt to it (the playground)."""

from __future__ import annotations

from typing import Any

from vllm_omni.entrypoints.async_omni_llm import AsyncOmniLLM

# Multimodal inputs a chat message can carry, by vLLM's modality name.
CHAT_INPUTS = ("image", "audio", "video")


def input_modalities(omni: AsyncOmniLLM) -> list[str]:
    """Text, plus the modalities the text stage's model takes (from vLLM's model class)."""
    stage = omni.text_stage
    if stage is None:
        return ["text"]
    config = stage.model_config
    if not config.is_multimodal_model:
        return ["text"]
    from vllm.model_executor.models import ModelRegistry

    model_cls, _ = ModelRegistry.resolve_model_cls(config.architectures, config)
    found = ["text"]
    for modality in CHAT_INPUTS:
        try:
            if model_cls.get_placeholder_str(modality, 1) is not None:
                found.append(modality)
        except (ValueError, NotImplementedError):
            pass
    return found


def pipeline_info(omni: AsyncOmniLLM, served_model_names: list[str]) -> dict[str, Any]:
    finals = [s for s in omni.order if s.final_output]
    image, audio, text = omni.image_stage, omni.audio_stage, omni.text_stage
    video = omni.video_stage
    return {
        "model": served_model_names[0],
        "pipeline": omni.pipeline.name,
        "stages": [{"name": s.name, "engine": s.engine, "output": s.output,
                    "inputs": s.inputs, "final_output": s.final_output} for s in omni.order],
        "outputs": sorted({s.output for s in finals}),
        "default_modalities": omni.pipeline.default_modalities,
        "inputs": input_modalities(omni),
        "max_model_len": text.max_model_len if text else None,
        "image": image and {
            "stage": image.name, "edits": bool(image.engine.info.get("takes_images")),
            "family": image.engine.info.get("family"),
            "step_level": image.engine.info.get("step_level"),
            "defaults": image.engine.info.get("defaults"),
        },
        "video": video and {
            "stage": video.name, "family": video.engine.info.get("family"),
            "from_image": bool(video.engine.info.get("takes_images")),
            "defaults": video.engine.info.get("defaults"),
        },
        "audio": audio and {"stage": audio.name, "voices": audio.speakers,
                            "sample_rate": audio.sample_rate},
    }
