"""vLLM general plugin: runs in every process vLLM starts (API, engine core, workers)."""

TALKER = "vllm_omni.models.qwen2_5_omni.talker:Qwen2_5OmniTalkerForCodecGeneration"
QWEN3_THINKER = (
    "vllm_omni.models.qwen3_omni.thinker:Qwen3OmniMoeThinkerWithTalkerRows"
)
QWEN3_TALKER = "vllm_omni.models.qwen3_omni.talker:Qwen3OmniMoeTalkerForCodecGeneration"
EDIT_ENCODER = "vllm_omni.models.qwen_image.encoder:QwenImageEditTextEncoder"


def register() -> None:
    from vllm import ModelRegistry

    from vllm_omni.compat.torchvision_free import install

    install()
    supported = ModelRegistry.get_supported_archs()
    if "Qwen2_5OmniTalkerForCodecGeneration" not in supported:
        ModelRegistry.register_model("Qwen2_5OmniTalkerForCodecGeneration", TALKER)
    if "Qwen3OmniMoeThinkerWithTalkerRows" not in supported:
        ModelRegistry.register_model("Qwen3OmniMoeThinkerWithTalkerRows", QWEN3_THINKER)
    if "Qwen3OmniMoeTalkerForCodecGeneration" not in supported:
        ModelRegistry.register_model("Qwen3OmniMoeTalkerForCodecGeneration", QWEN3_TALKER)
    if "QwenImageEditTextEncoder" not in supported:
        ModelRegistry.register_model("QwenImageEditTextEncoder", EDIT_ENCODER)
