"""Multi-adapter LoRA ops: batch metadata, the CPU path and the Triton SGMV/BGMV kernels."""
