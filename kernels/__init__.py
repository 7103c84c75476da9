"""Tensor ops of the serving stack: multi-adapter LoRA (SGMV/BGMV), paged attention, the fused
per-token ops of the decoder block (norms, SiLU-and-multiply, rotary + KV write), the sampler's
max/logsumexp, and the projections' matmuls.

Pure tensor functions with no knowledge of requests or adapters' names, reached through one backend
per device: `kernels.backend_for(device)` (Triton on CUDA, the compiled CPU ops on CPU, plain PyTorch
elsewhere; see `kernels.backends`). `kernels.reference` holds the plain PyTorch twin of every op, the
tests' oracle."""
from kernels.attention.plans import StepSequences
from kernels.backends import BACKEND_NAMES, Backend, backend_for

__all__ = ["BACKEND_NAMES", "Backend", "StepSequences", "backend_for"]
