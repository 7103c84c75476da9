"""Which cores the service's parts compute on (server/cpu_placement.py), over fake topologies: the
replicas' core sets (disjoint, balanced, within a NUMA node where they can be, refused past one per
core), the NUMA nodes read as the kernel lists them, and the single server's engine and service
CPUs; and pinning a thread, checked on this machine."""
from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from server.cpu_placement import (MIN_CORES_FOR_A_SERVICE_CORE, numa_nodes, pin_this_thread, place_service,
                                  split_cores)


def _assert_partition(sets: list[tuple[int, ...]], cores: list[int]) -> None:
    flat = [core for core_set in sets for core in core_set]
    assert sorted(flat) == sorted(cores), "every core in exactly one set"
    sizes = [len(core_set) for core_set in sets]
    assert max(sizes) - min(sizes) <= 1


@pytest.mark.parametrize("num_cores, num_sets", [(2, 1), (2, 2), (7, 3), (16, 5), (64, 64), (3, 2)])
def test_one_node_is_cut_into_balanced_disjoint_sets(num_cores: int, num_sets: int) -> None:
    cores = list(range(num_cores))
    sets = split_cores(cores, {}, num_sets)
    assert len(sets) == num_sets
    _assert_partition(sets, cores)


def test_two_replicas_on_two_cores_get_one_core_each() -> None:
    assert split_cores([0, 1], {0: 0, 1: 0}, 2) == [(0,), (1,)]


def test_sets_stay_within_a_numa_node() -> None:
    """Two sockets of 8 cores (node 1's CPUs numbered first, as some firmware does)."""
    node_of = {cpu: 1 if cpu < 8 else 0 for cpu in range(16)}
    for num_sets in (2, 4, 6, 8, 16):
        sets = split_cores(list(range(16)), node_of, num_sets)
        _assert_partition(sets, list(range(16)))
        assert all(len({node_of[core] for core in core_set}) == 1 for core_set in sets), num_sets
    assert split_cores(list(range(16)), node_of, 2) == [tuple(range(8, 16)), tuple(range(8))]


def test_unequal_nodes_share_sets_in_proportion() -> None:
    node_of = {cpu: 0 if cpu < 12 else 1 for cpu in range(16)}  # 12 cores and 4
    sets = split_cores(list(range(16)), node_of, 4)
    assert [len(core_set) for core_set in sets] == [4, 4, 4, 4]
    assert all(len({node_of[core] for core in core_set}) == 1 for core_set in sets)


def test_fewer_sets_than_nodes_take_whole_nodes() -> None:
    node_of = {cpu: cpu // 4 for cpu in range(16)}  # four nodes of 4
    assert split_cores(list(range(16)), node_of, 2) == [tuple(range(8)), tuple(range(8, 16))]


def test_more_replicas_than_cores_are_refused_naming_both() -> None:
    with pytest.raises(ValueError, match="3 replicas need a physical core each; this process may use 2"):
        split_cores([0, 1], {}, 3)
    with pytest.raises(ValueError):
        split_cores([0, 1], {}, 0)


def test_numa_nodes_as_the_kernel_lists_them(tmp_path: Path) -> None:
    for node, cpu_list in ((0, "0-3,8-11"), (1, "4-7,12-15")):
        (tmp_path / f"node{node}").mkdir()
        (tmp_path / f"node{node}" / "cpulist").write_text(cpu_list + "\n")
    (tmp_path / "online").write_text("0-1\n")  # not a node
    node_of = numa_nodes(tmp_path)
    assert node_of == {**dict.fromkeys([0, 1, 2, 3, 8, 9, 10, 11], 0), **dict.fromkeys([4, 5, 6, 7, 12, 13, 14, 15], 1)}
    assert numa_nodes(tmp_path / "absent") == {}


def test_small_machines_share_every_cpu_between_engine_and_service() -> None:
    placement = place_service([0, 1], {0, 1})
    assert placement.is_shared and placement.engine_cpus == (0, 1)
    three = place_service([0, 1, 2], {0, 1, 2, 3, 4, 5})
    assert three.is_shared and three.engine_cpus == (0, 1, 2, 3, 4, 5)


def test_larger_machines_keep_the_lowest_core_and_the_smt_siblings_for_the_service() -> None:
    """8 cores, 16 CPUs (siblings n and n + 8): the engine gets cores 1-7, one thread each."""
    placement = place_service(list(range(8)), set(range(16)))
    assert placement.engine_cpus == tuple(range(1, 8))
    assert placement.service_cpus == (0, *range(8, 16))
    assert not placement.is_shared
    assert len(place_service(list(range(MIN_CORES_FOR_A_SERVICE_CORE)), set(range(4))).engine_cpus) == 3


def test_a_pinned_thread_and_the_threads_it_starts_run_where_pinned() -> None:
    allowed = sorted(os.sched_getaffinity(0))
    seen: dict[str, set[int]] = {}

    def child() -> None:
        seen["child"] = os.sched_getaffinity(0)

    def pinned() -> None:
        pin_this_thread({allowed[0]})
        seen["pinned"] = os.sched_getaffinity(0)
        started = threading.Thread(target=child)
        started.start()
        started.join()

    thread = threading.Thread(target=pinned)
    thread.start()
    thread.join()
    assert seen == {"pinned": {allowed[0]}, "child": {allowed[0]}}
    assert sorted(os.sched_getaffinity(0)) == allowed, "the other threads keep their mask"


def test_the_compute_threads_a_pinned_thread_starts_run_where_it_is_pinned() -> None:
    """What `AsyncEngine(cpus=...)` counts on: PyTorch's OpenMP team is started by the thread that
    first runs a parallel op, and inherits that thread's CPUs."""
    import torch

    allowed = sorted(os.sched_getaffinity(0))
    before_threads, num_threads = set(os.listdir("/proc/self/task")), torch.get_num_threads()
    seen: dict[int, set[int]] = {}

    def pinned() -> None:
        pin_this_thread({allowed[-1]})
        torch.ones(1 << 22).exp_()  # far past a parallel op's grain: every thread of the team works
        for thread_id in set(os.listdir("/proc/self/task")) - before_threads:
            seen[int(thread_id)] = os.sched_getaffinity(int(thread_id))

    torch.set_num_threads(2)
    try:
        thread = threading.Thread(target=pinned)
        thread.start()
        thread.join()
    finally:
        torch.set_num_threads(num_threads)
    assert len(seen) >= 2, "the pinned thread and at least one compute thread it started"
    assert all(cpus == {allowed[-1]} for cpus in seen.values()), seen
