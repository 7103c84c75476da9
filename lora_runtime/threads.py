"""How many compute threads the engine runs: by default one per physical core the process may run
on, as llama.cpp does. Its matmuls, LoRA op, attention and per-token ops split their work over
PyTorch's thread pool (`torch.set_num_threads`, kernels/csrc/bindings.cpp), the one pool that
PyTorch's own ops use too, so the two never oversubscribe the cores.

Physical cores, not hardware threads: two SMT siblings share one core's vector units, and the
kernels are bound by those units (or by memory), so a second thread on a core adds little and costs
synchronisation. The process's affinity mask, not the machine: a container, `taskset` or a replica
pinned to its cores (server.cluster) sees only its own CPUs."""
from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path


_CPU_TOPOLOGY = Path("/sys/devices/system/cpu")


def parse_cpu_list(text: str) -> set[int]:
    """The CPUs of a kernel CPU list such as "0-3,8,10-11"."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if part:
            first, _, last = part.partition("-")
            cpus.update(range(int(first), int(last or first) + 1))
    return cpus


def physical_cores(cpus: Iterable[int], topology: Path = _CPU_TOPOLOGY) -> list[int]:
    """One CPU of `cpus` per physical core (the lowest of its SMT siblings there), in order. A CPU
    whose siblings the system does not say counts as a core of its own."""
    chosen: list[int] = []
    covered: set[int] = set()
    for cpu in sorted(cpus):
        if cpu in covered:
            continue
        chosen.append(cpu)
        siblings = topology / f"cpu{cpu}" / "topology" / "thread_siblings_list"
        covered |= parse_cpu_list(siblings.read_text()) if siblings.is_file() else {cpu}
    return chosen


def default_num_threads() -> tuple[int, str]:
    """OMP_NUM_THREADS where set (OpenMP's own setting, which an operator or a test run may give),
    else the physical cores of this process's affinity mask; with where the count came from."""
    configured = os.environ.get("OMP_NUM_THREADS", "").strip()
    if configured.isdigit() and int(configured) > 0:
        return int(configured), "OMP_NUM_THREADS"
    allowed = os.sched_getaffinity(0)
    cores = physical_cores(allowed)
    return max(1, len(cores)), f"the physical cores of the process's {len(allowed)} CPUs"


def use_threads(num_threads: int | None) -> tuple[int, str]:
    """Set PyTorch's pool (ours too) to `num_threads`, or to the default where None; returns the count
    and where it came from."""
    count, source = (num_threads, "configured") if num_threads is not None else default_num_threads()
    import torch  # here, not above: the service reads the topology helpers without loading torch

    torch.set_num_threads(count)
    return count, source
