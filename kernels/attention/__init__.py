"""Paged attention: per-step metadata, the CPU path and the Triton kernels."""
