"""Fused kernels the model layers call instead of chains of small aten ops (see cpu_kernels.py)."""
