"""Qwen-Image: its Qwen2.5-VL text encoder on vLLM feeding the DiT stage."""
