"""Memory of loading a checkpoint: this process's RSS before `load_model`, after it and at its peak
(VmHWM), against the bytes the model's tensors hold, on a random-weight model of Llama-3.2-1B's shape
(built once by `benchmarks.random_model`, cut to `--layers` layers in a directory of its own as
`benchmarks.threads` cuts it; 2 by default: the shape of every layer is the full model's) or on `--model DIR`, with the CPU backend, in bf16, one thread.

    python -m benchmarks.load_memory [--layers 2] [--model DIR]

Prints the two ratios that size a bigger model: (RSS after - before) / held (1.0: nothing kept beyond
the weights) and the peak's excess over the held bytes (a tensor read, in flight beside its packed
copy: for a tied head, the embedding early in the load), and from them the expected peak of loading a model of Llama-3.1-8B's shape (16 GB of
bf16 weights), which it does not build. Run it in a process of its own: VmHWM is the process's peak."""
from __future__ import annotations

import argparse
import logging
import time
import types
from pathlib import Path

import torch

import kernels
from benchmarks.random_model import random_llama
from lora_runtime.loader import load_model

LOG = logging.getLogger("benchmarks.load_memory")
MIB = 2**20
# Llama-3.1-8B: 32 layers of hidden 4096, MLP 14336, 32/8 heads of 128; vocabulary 128256, untied.
LLAMA_3_1_8B_PARAMS = 2 * 128256 * 4096 + 32 * (2 * 4096 * 4096 + 2 * 1024 * 4096 + 3 * 14336 * 4096)
# In flight at the end of the load, when the most is held: the last layer's fused gate/up, read plain
# then packed (the head, larger, is read first, when little else is held).
LLAMA_3_1_8B_LAST_IN_FLIGHT_PARAMS = 2 * 14336 * 4096


def _status_mib(key: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024
    raise KeyError(key)


def held_bytes(obj: object, seen: set[int] | None = None, depth: int = 0) -> int:
    """Bytes of the elements of the tensors reachable from `obj` through lists, dicts and slotted or
    plain attributes, each tensor once (not their storages': a packed weight's mapping has up to a huge
    page of alignment beside it that is never touched)."""
    seen = set() if seen is None else seen
    if isinstance(obj, torch.Tensor):
        key = id(obj) if obj.is_mkldnn else obj.data_ptr()
        if key in seen:
            return 0
        seen.add(key)
        return obj.numel() * obj.element_size()
    if depth > 8 or obj is None or isinstance(obj, (str, bytes, int, float, bool, torch.dtype, torch.device,
                                                    types.ModuleType)):
        return 0
    if isinstance(obj, (list, tuple)):
        return sum(held_bytes(item, seen, depth + 1) for item in obj)
    if isinstance(obj, dict):
        return sum(held_bytes(item, seen, depth + 1) for item in obj.values())
    names = {name for cls in type(obj).__mro__ for name in getattr(cls, "__slots__", ())}
    names |= set(getattr(obj, "__dict__", {}))
    return sum(held_bytes(getattr(obj, name), seen, depth + 1) for name in names if hasattr(obj, name)
               and not callable(getattr(type(obj), name, None)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--model", type=Path, default=None)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.set_num_threads(1)
    model_dir = args.model or random_llama(args.layers)
    from transformers import AutoConfig  # load_model's import: the library's memory, not the load's

    AutoConfig.from_pretrained(model_dir)
    before = _status_mib("VmRSS")
    started = time.perf_counter()
    model = load_model(model_dir, "bfloat16", "cpu", kernels.backend_for("cpu"))
    seconds = time.perf_counter() - started
    after, peak = _status_mib("VmRSS"), _status_mib("VmHWM")
    held = held_bytes(model) / MIB
    checkpoint = sum(path.stat().st_size for path in model_dir.glob("*.safetensors")) / MIB
    LOG.info("%s: checkpoint %.0f MiB, model holds %.0f MiB, loaded in %.1f s", model_dir.name, checkpoint, held, seconds)
    LOG.info("RSS before %.0f MiB, after %.0f MiB, peak %.0f MiB", before, after, peak)
    kept, in_flight = (after - before) / held, peak - before - held
    LOG.info("(after - before) / held = %.3f; peak - before - held = %.0f MiB", kept, in_flight)
    weights_8b = LLAMA_3_1_8B_PARAMS * 2 / MIB
    largest_8b = LLAMA_3_1_8B_LAST_IN_FLIGHT_PARAMS * 2 / MIB
    LOG.info("expected for Llama-3.1-8B's shape: weights %.0f MiB; peak of loading ~%.0f MiB "
             "(libraries %.0f + weights x %.3f + last tensor in flight %.0f), before KV cache and adapter pools",
             weights_8b, before + weights_8b * kept + largest_8b, before, kept, largest_8b)


if __name__ == "__main__":
    main()
