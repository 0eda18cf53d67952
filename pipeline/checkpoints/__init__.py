"""Safetensors checkpoints as mxspec reads and writes them: the folder layout (stated once), the shard
reader, FP8 sources, and the real Qwen3.5/DFlash configs stored as data (`configs/`)."""
