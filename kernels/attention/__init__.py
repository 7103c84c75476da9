"""Paged attention: per-backend step plans, the PyTorch path and the Triton kernels (the compiled CPU
op is in kernels/csrc/attention.cpp)."""
