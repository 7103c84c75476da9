"""`scripts/gpu_check.sh --dry-run`: the GPU check's every step and entry point on CPU tensors with
tiny settings, so the script that a GPU machine runs keeps working between the rare runs there."""
from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
STEPS = ["environment", "kernel_tests", "model", "engine_oracles", "bench_engine", "bench_kernels"]


def test_the_dry_run_passes_every_step(tmp_path) -> None:
    env = {**os.environ, "PYTHON": sys.executable}
    env.pop("OUT", None)
    done = subprocess.run([str(REPO / "scripts" / "gpu_check.sh"), str(tmp_path), "--dry-run"], env=env,
                          capture_output=True, text=True, timeout=600)
    summary = json.loads((tmp_path / "summary.json").read_text())
    failed = {name: step.get("error") for name, step in summary["steps"].items() if step["status"] != "pass"}
    assert done.returncode == 0 and not failed, (failed, done.stdout[-3000:], done.stderr[-3000:])
    assert list(summary["steps"]) == STEPS and summary["passed"] and summary["device"] == "cpu"
    figures = {name: step["figures"] for name, step in summary["steps"].items()}
    assert figures["kernel_tests"]["tests"] == 4 and figures["kernel_tests"]["failures"] == 0
    assert {check["pass"] for check in figures["engine_oracles"].values()} == {True}
    assert {"ours", "ours_adapters", "hf_generate", "peft_generate"} <= figures["bench_engine"].keys()
    assert all(row["of_copy_rate"] > 0 for row in figures["bench_kernels"]["lora"] + figures["bench_kernels"]["attention"])
    assert "===== bench_kernels =====" in (tmp_path / "gpu_check.log").read_text()


def test_a_failing_step_is_reported_and_the_next_ones_still_run(tmp_path) -> None:
    """An exception and a process past its time limit each fail their step; the run goes on."""
    from benchmarks import gpu_check

    run = gpu_check.Run(tmp_path, tmp_path, dry_run=True, deadline=time.monotonic() + 60)
    summary, log = gpu_check.Summary(run), io.StringIO()
    sleeper = gpu_check.Command([sys.executable, "-c", "import time; time.sleep(60)"], {}, 1, lambda _: {})
    gpu_check.run_step(summary, "raises", log, lambda: 1 / 0)
    gpu_check.run_step(summary, "hangs", log, lambda: gpu_check.run_command(run, sleeper, log))
    gpu_check.run_step(summary, "passes", log, lambda: {"figure": 1})
    written = json.loads((tmp_path / "summary.json").read_text())
    steps = written["steps"]
    assert steps["raises"]["status"] == "fail" and "ZeroDivisionError" in steps["raises"]["error"]
    assert steps["hangs"]["status"] == "fail" and "time limit of 1 s" in steps["hangs"]["error"]
    assert steps["passes"] == {"status": "pass", "seconds": steps["passes"]["seconds"], "figures": {"figure": 1}}
    assert written["passed"] is False
