"""llama.cpp's `llama-server` as a peer for `benchmarks.peers`: built from the C++ source that PyPI's
`llama-cpp-python` sdist vendors (its wheel builds only the libraries), our model and PEFT adapters
converted to GGUF with the vendored converters, and one timed burst of concurrent `/completion` calls.

Everything lands under `<cache>/peers/` and is reused: the build takes 7-17 minutes on one core.
"""
from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import IO, Self

import httpx

from lora_runtime.embedded import default_cache_dir

logger = logging.getLogger("benchmarks.llama_cpp")

# The sdist whose vendored llama.cpp we build: pinned, so every run measures the same server.
LLAMA_CPP_PYTHON_VERSION = "0.3.36"
# GCC 12's `_tile_loadconfig` (amxtileintrin.h) declares that `ldtilecfg` reads 8 bytes of its 64-byte
# operand, so dead-store elimination drops the stores of the tile rows and widths before it. ggml's AMX
# kernels (Q8_0, Q4_K and other quantized weights, on CPUs with AMX-INT8 under GGML_NATIVE) then load a
# configuration of empty tiles, and their first tile instruction dies with SIGILL. Turning the pass off
# keeps those stores (its cost to the rest of ggml is not measured: its hot loops are intrinsics).
KEEP_STORES_FLAGS = "-fno-dse -fno-tree-dse"
# Binaries built before KEEP_STORES_FLAGS crash on AMX CPUs: a new build directory, not reused.
BUILD_DIR = "build-keep-stores"
CMAKE_OPTIONS = (
    "-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_TOOLS=ON", "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_BUILD_APP=OFF", "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_OPENSSL=OFF", "-DBUILD_SHARED_LIBS=OFF", "-DGGML_NATIVE=ON",
    f"-DCMAKE_C_FLAGS={KEEP_STORES_FLAGS}", f"-DCMAKE_CXX_FLAGS={KEEP_STORES_FLAGS}",
)
# llama.cpp rounds each slot's context up to a multiple of this (llama_context's GGML_PAD).
CONTEXT_PAD_TOKENS = 256
HEALTH_TIMEOUT_S = 180.0
# Lines of a dead server's log kept in the report: its last words name the cause (a failed load, an
# unsupported type) without the thousands of lines loading printed before them.
LOG_TAIL_LINES = 12


def llama_cpp_root() -> Path:
    return default_cache_dir() / "peers" / f"llama.cpp-{LLAMA_CPP_PYTHON_VERSION}"


def tool_binary(root: Path, target: str) -> Path:
    return root / BUILD_DIR / "bin" / target


def server_binary(root: Path) -> Path:
    return tool_binary(root, "llama-server")


def is_built(binary: Path) -> bool:
    """A binary counts only if it runs: an interrupted link can leave a partial file behind. `--help`
    is a question every tool answers (llama-quantize with exit status 1, after its usage text); a
    partial file fails to execute or dies of a signal instead."""
    if not binary.is_file():
        return False
    try:
        probe = subprocess.run([str(binary), "--help"], check=False, capture_output=True, timeout=60)
    except OSError:
        return False
    return probe.returncode in (0, 1) and bool(probe.stdout)


def ensure_server(root: Path) -> Path:
    return ensure_tool(root, "llama-server")


def ensure_quantize(root: Path) -> Path:
    return ensure_tool(root, "llama-quantize")


def ensure_tool(root: Path, target: str) -> Path:
    """The cached binary of the vendored source's cmake `target`, fetched and built first where
    missing. cmake resumes an interrupted build in place, so a partial build directory is reused
    rather than deleted, and the tools share the libraries already built for another."""
    binary = tool_binary(root, target)
    if is_built(binary):
        return binary
    source = ensure_source(root)
    build, log = root / BUILD_DIR, root / f"{BUILD_DIR}.log"
    logger.info("building %s in %s (7-17 minutes on one core; log: %s)", target, build, log)
    cores = str(os.cpu_count() or 1)
    _run_logged(["cmake", "-S", str(source), "-B", str(build), *CMAKE_OPTIONS], log)
    _run_logged(["cmake", "--build", str(build), "--target", target, "-j", cores], log)
    if not is_built(binary):
        raise RuntimeError(f"built {target} does not run --help: {binary}")
    return binary


def ensure_source(root: Path) -> Path:
    """`root/src`: `vendor/llama.cpp` of the pinned sdist, extracted beside it and renamed into place
    whole, so a run interrupted while extracting leaves no half tree that looks complete."""
    source = root / "src"
    if (source / "CMakeLists.txt").is_file():
        return source
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root) as scratch:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                        f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}", "-d", scratch], check=True)
        (sdist,) = Path(scratch).glob("llama_cpp_python-*.tar.gz")
        extracted = Path(scratch) / "vendored"
        _extract_vendored(sdist, extracted)
        extracted.rename(source)
    return source


def _extract_vendored(sdist: Path, into: Path) -> None:
    with tarfile.open(sdist) as archive:
        prefix = f"{archive.getnames()[0].split('/')[0]}/vendor/llama.cpp/"
        members = [m for m in archive.getmembers() if m.name.startswith(prefix)]
        for member in members:
            member.name = member.name[len(prefix):]
        archive.extractall(into, members=[m for m in members if m.name], filter="data")


def _run_logged(command: list[str], log: Path) -> None:
    with log.open("a") as out:
        completed = subprocess.run(command, check=False, stdout=out, stderr=subprocess.STDOUT)
    if completed.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed ({completed.returncode}):\n{_tail(log.read_bytes())}")


def _tail(data: bytes, num_chars: int = 3000) -> str:
    return data.decode(errors="replace")[-num_chars:]


def convert_model(root: Path, model_dir: Path, outtype: str) -> Path:
    """`model_dir` as GGUF of `outtype` (f32, bf16), converted once by the vendored converter."""
    target = _gguf_path(model_dir, outtype)
    if not target.is_file():
        with tempfile.TemporaryDirectory() as scratch:
            staged = stage_model_dir(model_dir, Path(scratch))
            _convert(root, "convert_hf_to_gguf.py", [str(staged)], outtype, target)
    return target


# GGUF types the converter writes itself; every other type is quantized from its bf16 file.
CONVERTER_TYPES = ("f32", "f16", "bf16")


def model_file(root: Path, model_dir: Path, outtype: str) -> Path:
    """`model_dir` as a GGUF file of `outtype`: a converter type (f32, f16, bf16), or any type the
    vendored `llama-quantize` names (q8_0, q4_k_m, ...), quantized from the bf16 file once."""
    if outtype in CONVERTER_TYPES:
        return convert_model(root, model_dir, outtype)
    return quantize_model(root, convert_model(root, model_dir, "bf16"), outtype)


def quantize_model(root: Path, source: Path, outtype: str) -> Path:
    """`source` quantized to `outtype` by the vendored `llama-quantize` (its default mixture of tensor
    types for a K-quant "_M" type), once, written under a temporary name renamed into place."""
    target = source.with_name(f"{source.stem.removesuffix('-bf16')}-{outtype}.gguf")
    if not target.is_file():
        binary = ensure_quantize(root)
        partial = target.with_name(f"{target.stem}.partial-{os.getpid()}.gguf")
        command = [str(binary), str(source), str(partial), outtype.upper(), str(os.cpu_count() or 1)]
        completed = subprocess.run(command, check=False, capture_output=True)
        if completed.returncode != 0:
            partial.unlink(missing_ok=True)
            raise RuntimeError(f"llama-quantize failed ({completed.returncode}):\n{_tail(completed.stdout + completed.stderr)}")
        os.replace(partial, target)
    return target


def convert_adapter(root: Path, adapter_dir: Path, model_dir: Path, outtype: str) -> Path:
    """The PEFT adapter at `adapter_dir` as a GGUF LoRA of `outtype`, converted once."""
    target = _gguf_path(adapter_dir, outtype)
    if not target.is_file():
        with tempfile.TemporaryDirectory() as scratch:
            staged = stage_model_dir(model_dir, Path(scratch))
            _convert(root, "convert_lora_to_gguf.py", [str(adapter_dir), "--base", str(staged)], outtype, target)
    return target


def stage_model_dir(model_dir: Path, scratch: Path) -> Path:
    """A view of `model_dir` (links to its files) whose config names the architecture: the converter
    picks its model class from `architectures`, which our embedded model's config leaves out."""
    staged = scratch / model_dir.name
    staged.mkdir()
    for path in model_dir.iterdir():
        if path.name != "config.json":
            (staged / path.name).symlink_to(path.resolve())
    config = json.loads((model_dir / "config.json").read_text())
    if not config.get("architectures") and config.get("model_type") == "llama":
        config["architectures"] = ["LlamaForCausalLM"]
    (staged / "config.json").write_text(json.dumps(config, indent=2))
    return staged


def _gguf_path(source_dir: Path, outtype: str) -> Path:
    """Keyed by name, a fingerprint of the weights file (a regenerated adapter of the same name must
    not reuse a stale conversion) and the dtype."""
    weights = sorted(source_dir.glob("*.safetensors"))
    stats = [(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in weights]
    fingerprint = hashlib.sha256(repr(stats).encode()).hexdigest()[:10]
    return default_cache_dir() / "peers" / "gguf" / f"{source_dir.name}-{fingerprint}-{outtype}.gguf"


def _convert(root: Path, script: str, arguments: list[str], outtype: str, target: Path) -> None:
    """Runs a vendored converter with the vendored `gguf` package first on the path (ours may be older),
    writing to a temporary name renamed into place only when it succeeded."""
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f"{target.stem}.partial-{os.getpid()}.gguf")
    source = root / "src"
    env = os.environ | {"PYTHONPATH": os.pathsep.join([str(source / "gguf-py"), os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, str(source / script), *arguments, "--outtype", outtype, "--outfile", str(partial)]
    completed = subprocess.run(command, check=False, capture_output=True, env=env)
    if completed.returncode != 0:
        partial.unlink(missing_ok=True)
        raise RuntimeError(f"{script} failed ({completed.returncode}):\n{_tail(completed.stderr)}")
    os.replace(partial, target)


def server_command(binary: Path, model: Path, loras: list[Path], port: int, num_slots: int,
                   slot_context_tokens: int, threads: int) -> list[str]:
    """One thread for batches and single tokens alike; every slot's context holds a prompt and its new
    tokens; adapters loaded but applied only as each request's `lora` list says; no prompt cache kept
    on the host (`--cache-ram 0`), since no request may reuse another's KV."""
    slot_tokens = -(-slot_context_tokens // CONTEXT_PAD_TOKENS) * CONTEXT_PAD_TOKENS
    command = [str(binary), "-m", str(model), "--host", "127.0.0.1", "--port", str(port),
               "-t", str(threads), "-tb", str(threads), "-np", str(num_slots), "-c", str(num_slots * slot_tokens),
               "--cache-ram", "0"]
    for lora in loras:
        command += ["--lora", str(lora)]
    return command + (["--lora-init-without-apply"] if loras else [])


def lora_scales(adapter_idx: int | None, num_adapters: int) -> list[dict]:
    """Every loaded adapter's scale, the request's own at 1 and the rest at 0. Spelled out in full: a
    request without a list runs every adapter at its load-time scale (1.0, even with
    --lora-init-without-apply, which only skips applying them at startup)."""
    return [{"id": j, "scale": 1.0 if j == adapter_idx else 0.0} for j in range(num_adapters)]


def completion_body(prompt: list[int], new_tokens: int, adapter_idx: int | None, num_adapters: int) -> dict:
    """A greedy `/completion` request (temperature 0 picks the argmax) of exactly `new_tokens` tokens
    that neither reuses a cached prompt nor penalises repeats."""
    body = {"prompt": prompt, "n_predict": new_tokens, "ignore_eos": True, "temperature": 0.0, "top_k": 1,
            "repeat_penalty": 1.0, "cache_prompt": False}
    if num_adapters:
        body["lora"] = lora_scales(adapter_idx, num_adapters)
    return body


def stat_cpu_seconds(stat_line: str, ticks_per_s: int) -> float:
    """utime + stime of /proc/<pid>/stat (fields 14 and 15, every thread of the process). The command
    name (field 2) may hold spaces and parentheses, so fields are counted after its last ')'."""
    fields = stat_line[stat_line.rindex(")") + 2:].split()
    return (int(fields[11]) + int(fields[12])) / ticks_per_s


def process_cpu_seconds(pid: int) -> float:
    return stat_cpu_seconds(Path(f"/proc/{pid}/stat").read_text(), os.sysconf("SC_CLK_TCK"))


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class PeerDied(RuntimeError):
    """A peer's server that ended (an exit status, a signal), never became healthy or cut a burst off;
    `reason` says which, `log_tail` holds the last lines it printed."""

    def __init__(self, reason: str, log_tail: str) -> None:
        super().__init__(f"{reason}:\n{log_tail}")
        self.reason, self.log_tail = reason, log_tail


def exit_reason(returncode: int) -> str:
    """A `subprocess` return code in words: a negative one is the signal that ended the process."""
    if returncode >= 0:
        return f"exited with status {returncode}"
    try:
        return f"killed by {signal.Signals(-returncode).name}"
    except ValueError:
        return f"killed by signal {-returncode}"


class LlamaServer:
    """One `llama-server` process on a loopback port, its output kept in a file for error messages;
    terminated on exit from the `with` block, whatever happened inside it."""

    def __init__(self, command: list[str], port: int) -> None:
        self.command, self.url = command, f"http://127.0.0.1:{port}"
        self.log: IO[bytes] | None = None
        self.process: subprocess.Popen | None = None

    def __enter__(self) -> Self:
        self.log = tempfile.TemporaryFile()  # this object owns it until __exit__
        self.process = subprocess.Popen(self.command, stdout=self.log, stderr=subprocess.STDOUT)
        try:
            self.wait_healthy(HEALTH_TIMEOUT_S)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        assert self.process is not None
        self.process.terminate()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.log.close()

    def wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise self.death(exit_reason(self.process.returncode))
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    return
            except httpx.TransportError:
                pass  # not listening yet
            time.sleep(0.2)
        raise self.death(f"not healthy after {timeout_s:.0f} s")

    def death(self, reason: str) -> PeerDied:
        return PeerDied(f"llama-server {reason}", self.log_tail())

    def death_during_burst(self, error: httpx.TransportError) -> PeerDied:
        """What cut a burst off: the process's end where it ended (a dying server drops its connections
        an instant before it is gone, so its end is awaited a little), else the transport error."""
        try:
            return self.death(exit_reason(self.process.wait(timeout=5)))
        except subprocess.TimeoutExpired:
            return self.death(f"cut a burst off ({type(error).__name__}: {error})")

    def log_tail(self, num_lines: int = LOG_TAIL_LINES) -> str:
        self.log.seek(0)
        return "\n".join(self.log.read().decode(errors="replace").splitlines()[-num_lines:])

    def cpu_seconds(self) -> float:
        return process_cpu_seconds(self.process.pid)


def run_burst(server: LlamaServer, bodies: list[dict]) -> dict:
    """Two short warm-up requests, then every body at once; the server's CPU time (all its threads)
    and the wall time around the burst, in `benchmarks.timing.Timer.report`'s shape. Raises PeerDied
    where the server ended or dropped the requests."""
    warm_up = [body | {"n_predict": 2} for body in bodies[:2]]
    try:
        asyncio.run(_post_all(server.url, warm_up))
        cpu, wall = server.cpu_seconds(), time.perf_counter()
        replies = asyncio.run(_post_all(server.url, bodies))
        wall, cpu = time.perf_counter() - wall, server.cpu_seconds() - cpu
    except httpx.TransportError as error:
        raise server.death_during_burst(error) from error
    counts = [reply["tokens_predicted"] for reply in replies]
    assert counts == [body["n_predict"] for body in bodies], counts
    tokens = sum(counts)
    return {"tokens": tokens, "wall_s": wall, "cpu_s": cpu, "tokens_per_s": tokens / wall,
            "tokens_per_cpu_s": tokens / cpu}


async def _post_all(url: str, bodies: list[dict]) -> list[dict]:
    limits = httpx.Limits(max_connections=len(bodies))
    async with httpx.AsyncClient(base_url=url, timeout=3600, limits=limits) as client:
        responses = await asyncio.gather(*(client.post("/completion", json=body) for body in bodies))
    for response in responses:
        response.raise_for_status()
    return [response.json() for response in responses]
