"""Code2wav: codec tokens -> waveform (Qwen2.5-Omni's token2wav DiT + BigVGAN vocoder) as a
non-AR stage in its own process."""
