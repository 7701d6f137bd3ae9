"""Qwen3-Omni: the MoE thinker on vLLM's own model, with the rows its talker reads."""
