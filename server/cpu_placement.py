"""Which cores each part of the service computes on: the engine replicas of `python -m
server.cluster`, each on a set of physical cores of its own (a NUMA node's where there are several),
and, in `python -m server`, the engine apart from the service's own threads (event loop,
tokenization, adapter loads, uploads) on machines with cores to spare.

Pinning is by thread: Linux gives a new thread the affinity mask of the thread that creates it, and
the engine's compute threads (PyTorch's OpenMP team) are created by the thread that first runs a
parallel op: the engine loop, pinned before its first step. A process pinned before it loads its
model also has that memory placed on its own NUMA node (Linux allocates a page on the node of the
CPU that first touches it).
"""
from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from lora_runtime.threads import parse_cpu_list, physical_cores

logger = logging.getLogger(__name__)
_NODE_TOPOLOGY = Path("/sys/devices/system/node")
# From this many physical cores up, `python -m server` keeps one for the service's own threads: below
# it, a core taken from the engine costs more throughput (a half, a third) than the service's threads
# take from it when they share.
MIN_CORES_FOR_A_SERVICE_CORE = 4


def numa_nodes(topology: Path = _NODE_TOPOLOGY) -> dict[int, int]:
    """The NUMA node of each CPU the system lists (empty where it lists none: one node)."""
    node_of: dict[int, int] = {}
    for cpu_list in sorted(topology.glob("node[0-9]*/cpulist")):
        node = int(cpu_list.parent.name.removeprefix("node"))
        node_of.update(dict.fromkeys(parse_cpu_list(cpu_list.read_text()), node))
    return node_of


def allowed_cores() -> list[int]:
    """The physical cores of this process's affinity mask (one CPU each: `physical_cores`)."""
    return physical_cores(os.sched_getaffinity(0))


def split_cores(cores: Sequence[int], node_of: Mapping[int, int], num_sets: int) -> list[tuple[int, ...]]:
    """`cores` cut into `num_sets` disjoint sets of sizes differing by at most one, each within one
    NUMA node where there are at least as many sets as nodes (the nodes' cores shared among their
    sets in proportion); fewer sets than nodes are cut in node order (whole nodes each where the
    nodes' sizes allow). Raises ValueError past one set per
    core: a replica sharing a core with another adds no throughput and doubles both one's latency."""
    if num_sets < 1:
        raise ValueError("the number of core sets must be >= 1")
    if num_sets > len(cores):
        raise ValueError(f"{num_sets} replicas need a physical core each; this process may use "
                         f"{len(cores)} (CPUs {','.join(map(str, cores))})")
    by_node: dict[int, list[int]] = {}
    for core in sorted(cores, key=lambda cpu: (node_of.get(cpu, 0), cpu)):
        by_node.setdefault(node_of.get(core, 0), []).append(core)
    if num_sets < len(by_node):
        return _even_cuts([core for node_cores in by_node.values() for core in node_cores], num_sets)
    sets_per_node = _apportion([len(node_cores) for node_cores in by_node.values()], num_sets)
    return [core_set for node_cores, count in zip(by_node.values(), sets_per_node)
            for core_set in _even_cuts(node_cores, count)]


def _even_cuts(cores: Sequence[int], num_sets: int) -> list[tuple[int, ...]]:
    """`cores` in order, cut into `num_sets` runs whose sizes differ by at most one."""
    size, larger = divmod(len(cores), num_sets)
    cuts, start = [], 0
    for index in range(num_sets):
        end = start + size + (index < larger)
        cuts.append(tuple(cores[start:end]))
        start = end
    return cuts


def _apportion(num_cores: Sequence[int], num_sets: int) -> list[int]:
    """Sets per node, in proportion to its cores (largest remainders), at least one and at most its
    cores each. Needs len(num_cores) <= num_sets <= sum(num_cores)."""
    total = sum(num_cores)
    counts = [max(1, min(cores, num_sets * cores // total)) for cores in num_cores]
    while sum(counts) != num_sets:
        step = 1 if sum(counts) < num_sets else -1
        # The node whose cores per set are furthest from the mean gets (or gives) the next set.
        room = [index for index, count in enumerate(counts)
                if (count < num_cores[index] if step > 0 else count > 1)]
        index = max(room, key=lambda i: step * num_cores[i] / counts[i])
        counts[index] += step
    return counts


@dataclass(frozen=True, slots=True)
class CpuPlacement:
    """The CPUs of the engine (its loop and compute threads) and of the service's other threads;
    the same CPUs for both where they share."""

    engine_cpus: tuple[int, ...]
    service_cpus: tuple[int, ...]

    @property
    def is_shared(self) -> bool:
        return self.engine_cpus == self.service_cpus


def place_service(cores: Sequence[int], allowed_cpus: Collection[int]) -> CpuPlacement:
    """`python -m server`'s placement: from `MIN_CORES_FOR_A_SERVICE_CORE` physical cores up, the
    lowest core (where the kernel's own housekeeping tends to run) and every SMT sibling go to the
    service, the other cores to the engine, one compute thread each; below it, both share all."""
    if len(cores) < MIN_CORES_FOR_A_SERVICE_CORE:
        everything = tuple(sorted(allowed_cpus))
        return CpuPlacement(everything, everything)
    engine = tuple(sorted(cores)[1:])
    return CpuPlacement(engine, tuple(sorted(set(allowed_cpus) - set(engine))))


def service_placement(num_threads: int | None) -> CpuPlacement:
    """`python -m server`'s placement on this machine: `place_service` over this process's affinity
    mask; every CPU shared where the operator set the thread count (`--threads`): where those
    threads run is then theirs to say (`taskset`, `numactl`)."""
    allowed = os.sched_getaffinity(0)
    if num_threads is not None:
        return CpuPlacement(tuple(sorted(allowed)), tuple(sorted(allowed)))
    return place_service(allowed_cores(), allowed)


def pin_this_thread(cpus: Collection[int]) -> None:
    """Run the calling thread, and the threads it creates from now on, on `cpus` only."""
    os.sched_setaffinity(0, cpus)


def pin_this_process(cpus: Collection[int]) -> None:
    """Run every thread of this process, and those they create from now on, on `cpus` only."""
    for thread_id in os.listdir("/proc/self/task"):
        with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
            os.sched_setaffinity(int(thread_id), cpus)
