"""The engine's compute threads (lora_runtime/threads.py): one per physical core of the process's
affinity mask by default (checked under `taskset`), OMP_NUM_THREADS or `num_threads` where given;
and the same greedy tokens at 1 and 2 threads in float32, base model and adapters in one batch (every
op's split leaves each element's sum as it is: tests/kernels/test_cpu_threads.py)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lora_runtime import Engine, EngineConfig, SamplingParams
from lora_runtime.threads import parse_cpu_list, physical_cores
from tests.adapters.demo_behaviour import DEMO_DIR, HELD_OUT_QUESTIONS

ROOT = Path(__file__).resolve().parents[2]


def test_cpu_lists_as_the_kernel_writes_them() -> None:
    assert parse_cpu_list("0-3,8,10-11\n") == {0, 1, 2, 3, 8, 10, 11}
    assert parse_cpu_list("5") == {5}


def _topology(root: Path, siblings: dict[int, str]) -> Path:
    for cpu, text in siblings.items():
        directory = root / f"cpu{cpu}" / "topology"
        directory.mkdir(parents=True)
        (directory / "thread_siblings_list").write_text(text + "\n")
    return root


def test_one_thread_per_physical_core_of_the_allowed_cpus(tmp_path: Path) -> None:
    """Two cores of two SMT siblings each, numbered as Linux numbers them (siblings n and n + 2)."""
    topology = _topology(tmp_path, {0: "0,2", 1: "1,3", 2: "0,2", 3: "1,3"})
    assert physical_cores({0, 1, 2, 3}, topology) == [0, 1]
    assert physical_cores({2, 3}, topology) == [2, 3]  # a sibling stands for its core where the other is not allowed
    assert physical_cores({0, 2}, topology) == [0]
    assert physical_cores({7}, topology) == [7]  # no topology said: a core of its own


def _default_in_subprocess(cpus: str, omp_num_threads: str | None) -> int:
    environment = {key: value for key, value in os.environ.items() if key != "OMP_NUM_THREADS"}
    if omp_num_threads is not None:
        environment["OMP_NUM_THREADS"] = omp_num_threads
    code = "from lora_runtime.threads import default_num_threads; print(default_num_threads()[0])"
    result = subprocess.run(["taskset", "-c", cpus, sys.executable, "-c", code], env=environment, cwd=ROOT,
                            capture_output=True, text=True, check=True)
    return int(result.stdout)


def test_the_default_follows_the_affinity_mask_and_omp_num_threads() -> None:
    allowed = sorted(os.sched_getaffinity(0))
    cores = {Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list").read_text() for cpu in allowed}
    assert _default_in_subprocess(",".join(map(str, allowed)), None) == len(cores)
    assert _default_in_subprocess(str(allowed[0]), None) == 1
    assert _default_in_subprocess(str(allowed[0]), "3") == 3


@pytest.mark.slow
def test_greedy_tokens_at_one_and_two_threads_are_equal(embedded_model_dir) -> None:
    previous = torch.get_num_threads()
    try:
        engine = Engine.from_config(EngineConfig(model=str(embedded_model_dir), dtype="float32", num_threads=2))
        assert torch.get_num_threads() == 2 and engine.info.num_threads == 2
        questions = HELD_OUT_QUESTIONS[:3] * 3
        adapters = [None] * 3 + [str(DEMO_DIR / "french")] * 3 + [str(DEMO_DIR / "shout")] * 3
        params = SamplingParams(max_new_tokens=24, apply_chat_template=True, ignore_eos_token=True)
        two = [output.token_ids for output in engine.generate(questions, params, adapters=adapters)]
        torch.set_num_threads(1)
        one = [output.token_ids for output in engine.generate(questions, params, adapters=adapters)]
    finally:
        torch.set_num_threads(previous)
    assert all(len(tokens) == 24 for tokens in one)
    assert two == one
