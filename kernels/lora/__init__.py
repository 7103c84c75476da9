"""Multi-adapter LoRA ops: per-backend step plans, the PyTorch path and the Triton SGMV/BGMV kernels
(the compiled CPU op is in kernels/csrc/lora.cpp)."""
