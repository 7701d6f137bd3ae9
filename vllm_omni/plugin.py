"""vLLM general plugin: runs in every process vLLM starts (API, engine core, workers)."""

TALKER = "vllm_omni.models.qwen2_5_omni.talker:Qwen2_5OmniTalkerForCodecGeneration"


def register() -> None:
    from vllm import ModelRegistry

    from vllm_omni.compat.torchvision_free import install

    install()
    if "Qwen2_5OmniTalkerForCodecGeneration" not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model("Qwen2_5OmniTalkerForCodecGeneration", TALKER)
