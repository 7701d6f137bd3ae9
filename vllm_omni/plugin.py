"""vLLM general plugin: runs in every process vLLM starts (API, engine core, workers)."""


def register() -> None:
    from vllm_omni.compat.torchvision_free import install

    install()
