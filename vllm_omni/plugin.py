"""vLLM general plugin: runs in every process vLLM starts (API, engine core, workers)."""

TALKER = "vllm_omni.models.qwen2_5_omni.talker:Qwen2_5OmniTalkerForCodecGeneration"
EDIT_ENCODER = "vllm_omni.models.qwen_image.encoder:QwenImageEditTextEncoder"


def register() -> None:
    from vllm import ModelRegistry

    from vllm_omni.compat.torchvision_free import install

    install()
    supported = ModelRegistry.get_supported_archs()
    if "Qwen2_5OmniTalkerForCodecGeneration" not in supported:
        ModelRegistry.register_model("Qwen2_5OmniTalkerForCodecGeneration", TALKER)
    if "QwenImageEditTextEncoder" not in supported:
        ModelRegistry.register_model("QwenImageEditTextEncoder", EDIT_ENCODER)
