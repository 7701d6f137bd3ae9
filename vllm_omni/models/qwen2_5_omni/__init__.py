"""Qwen2.5-Omni's speech stages on vllm-omni: the talker as a vLLM model (the thinker is
vLLM's own), and the stage-to-stage glue."""
