"""Serving benchmark: drive the HTTP service with concurrent streaming requests and report
throughput, time to first token (TTFT) and time per output token (TPOT), p50 and p99, and errors.

    python -m benchmarks.serving                      # starts `python -m server` on a free port
    python -m benchmarks.serving --url http://H:P --token T --tenant demo --deployment NAME
    python -m benchmarks.serving --concurrency 1,8,64 --requests 64 --max-new-tokens 32 \
        --adapters a/1,b/1 --distribution zipf
    python -m benchmarks.serving --whole ...          # non-streamed `generate` requests

Each concurrency level runs `--requests` requests through a bounded pool of asyncio workers (one
httpx connection each). Results: `benchmarks/results/serving-<time>.json` and a PNG plot beside it.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from benchmarks.results_writer import RESULTS_DIR, write_results

logger = logging.getLogger("benchmarks.serving")
PROMPT = "Write a short story about a robot who learns to paint. Once upon a time,"


@dataclass(frozen=True, slots=True)
class Target:
    base_url: str
    token: str
    tenant: str
    deployment: str

    def stream_url(self) -> str:
        return f"{self.base_url}/{self.tenant}/deployments/v2/llms/{self.deployment}/generate_stream"

    def generate_url(self) -> str:
        return f"{self.base_url}/{self.tenant}/deployments/v2/llms/{self.deployment}/generate"


@dataclass(slots=True)
class Sample:
    """One request: seconds to first token and between tokens, tokens, or an error."""

    latency_s: float = 0.0
    ttft_s: float | None = None
    tpot_s: float | None = None
    num_tokens: int = 0
    error: str | None = None


@dataclass(slots=True)
class LevelReport:
    concurrency: int
    num_requests: int
    wall_s: float
    output_tokens_per_s: float
    requests_per_s: float
    ttft_ms: dict[str, float]
    tpot_ms: dict[str, float]
    latency_ms: dict[str, float]
    errors: dict[str, int] = field(default_factory=dict)


def adapter_picker(adapters: list[str], distribution: str, zipf_s: float, seed: int):
    """Draws adapter ids uniformly or by a Zipf law over their order (None: the base model)."""
    rng = random.Random(seed)
    if not adapters:
        return lambda: None
    weights = [1.0 / (rank ** zipf_s) if distribution == "zipf" else 1.0
               for rank in range(1, len(adapters) + 1)]
    return lambda: rng.choices(adapters, weights)[0]


async def one_request(http: httpx.AsyncClient, target: Target, max_new_tokens: int,
                      adapter_id: str | None, whole: bool = False) -> Sample:
    parameters = {"max_new_tokens": max_new_tokens, "ignore_eos_token": True}
    if adapter_id:
        parameters["adapter_id"] = adapter_id
    if whole:
        return await whole_request(http, target, parameters)
    sample, start, token_times = Sample(), time.perf_counter(), []
    async with http.stream("POST", target.stream_url(), json={"inputs": PROMPT, "parameters": parameters},
                           headers={"Authorization": f"Bearer {target.token}"}) as response:
        if response.status_code != 200:
            await response.aread()
            sample.error = f"{response.status_code} {response.json().get('error_type', '')}"
            return sample
        async for line in response.aiter_lines():
            if line.startswith("data:"):
                if "error_type" in line:
                    sample.error = "stream " + json.loads(line[5:]).get("error_type", "")
                token_times.append(time.perf_counter())
    sample.latency_s, sample.num_tokens = time.perf_counter() - start, len(token_times)
    if token_times:
        sample.ttft_s = token_times[0] - start
    if len(token_times) > 1:
        sample.tpot_s = (token_times[-1] - token_times[0]) / (len(token_times) - 1)
    return sample


async def whole_request(http: httpx.AsyncClient, target: Target, parameters: dict) -> Sample:
    """A non-streamed `generate`: its latency and tokens (no first-token or per-token times)."""
    start = time.perf_counter()
    response = await http.post(target.generate_url(), json={"inputs": PROMPT, "parameters": parameters},
                               headers={"Authorization": f"Bearer {target.token}"})
    if response.status_code != 200:
        return Sample(error=f"{response.status_code} {response.json().get('error_type', '')}")
    return Sample(latency_s=time.perf_counter() - start, num_tokens=int(response.headers["x-generated-tokens"]))


async def run_level(target: Target, concurrency: int, num_requests: int, max_new_tokens: int,
                    pick_adapter, whole: bool = False) -> LevelReport:
    queue: asyncio.Queue[str | None] = asyncio.Queue()
    for _ in range(num_requests):
        queue.put_nowait(pick_adapter())
    samples: list[Sample] = []

    async def worker() -> None:
        async with httpx.AsyncClient(timeout=600) as http:
            while not queue.empty():
                adapter_id = queue.get_nowait()
                try:
                    samples.append(await one_request(http, target, max_new_tokens, adapter_id, whole))
                except httpx.HTTPError as error:
                    samples.append(Sample(error=type(error).__name__))

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return summarize(concurrency, samples, time.perf_counter() - start)


def _percentiles_ms(values: list[float]) -> dict[str, float]:
    if not values:
        return {"p50": float("nan"), "p99": float("nan")}
    if len(values) == 1:
        return {"p50": values[0] * 1000, "p99": values[0] * 1000}
    cuts = statistics.quantiles(values, n=100, method="inclusive")
    return {"p50": statistics.median(values) * 1000, "p99": cuts[98] * 1000}


def summarize(concurrency: int, samples: list[Sample], wall_s: float) -> LevelReport:
    good = [s for s in samples if s.error is None]
    return LevelReport(
        concurrency=concurrency, num_requests=len(samples), wall_s=wall_s,
        output_tokens_per_s=sum(s.num_tokens for s in good) / wall_s,
        requests_per_s=len(good) / wall_s,
        ttft_ms=_percentiles_ms([s.ttft_s for s in good if s.ttft_s is not None]),
        tpot_ms=_percentiles_ms([s.tpot_s for s in good if s.tpot_s is not None]),
        latency_ms=_percentiles_ms([s.latency_s for s in good]),
        errors=dict(Counter(s.error for s in samples if s.error is not None)))


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@contextlib.contextmanager
def local_server(max_in_flight: int, engine_options: dict[str, str]) -> Iterator[Target]:
    """`python -m server` in a subprocess on a fresh data directory, using its demo token."""
    with tempfile.TemporaryDirectory(prefix="bench-serving-") as data_dir:
        port = _free_port()
        command = [sys.executable, "-m", "server", "--port", str(port), "--data-dir", data_dir,
                   "--max-in-flight", str(max_in_flight)]
        for name, value in engine_options.items():
            command += [f"--{name}", value]
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            base_url = f"http://127.0.0.1:{port}"
            _wait_healthy(base_url, process)
            token = (Path(data_dir) / "demo-token").read_text().strip()
            info = httpx.get(base_url + "/info", headers={"Authorization": f"Bearer {token}"}).json()
            yield Target(base_url, token, "demo", info["base_models"][0])
        finally:
            process.terminate()
            process.wait(60)


def _wait_healthy(base_url: str, process: subprocess.Popen, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with status {process.returncode}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(base_url + "/health", timeout=2).status_code == 200:
                return
        time.sleep(0.5)
    raise TimeoutError("server did not become healthy")


def plot(reports: list[LevelReport], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels = [r.concurrency for r in reports]
    figure, axes = plt.subplots(1, 3, figsize=(14, 4))
    axes[0].plot(levels, [r.output_tokens_per_s for r in reports], marker="o")
    axes[0].set(title="throughput", xlabel="concurrency", ylabel="output tokens / s")
    for axis, name, title in ((axes[1], "ttft_ms", "time to first token"),
                              (axes[2], "tpot_ms", "time per output token")):
        for quantile in ("p50", "p99"):
            axis.plot(levels, [getattr(r, name)[quantile] for r in reports], marker="o", label=quantile)
        axis.set(title=title, xlabel="concurrency", ylabel="ms")
        axis.legend()
    for axis in axes:
        axis.set_xscale("log", base=2)
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.serving", description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="target a running server instead of starting one")
    parser.add_argument("--token")
    parser.add_argument("--tenant", default="demo")
    parser.add_argument("--deployment", default="smollm2-135m-instruct")
    parser.add_argument("--concurrency", default="1,2,4,8,16,32,64")
    parser.add_argument("--requests", type=int, default=64, help="requests per concurrency level")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--adapters", default="", help="comma-separated adapter ids; empty: base model")
    parser.add_argument("--distribution", choices=("uniform", "zipf"), default="uniform")
    parser.add_argument("--whole", action="store_true",
                        help="non-streamed generate requests (latency only: no first-token or per-token times)")
    parser.add_argument("--zipf-s", type=float, default=1.1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model")
    parser.add_argument("--dtype")
    parser.add_argument("--device")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request otherwise
    args = _parse_args(argv)
    levels = [int(level) for level in args.concurrency.split(",")]
    adapters = [a for a in args.adapters.split(",") if a]
    pick = adapter_picker(adapters, args.distribution, args.zipf_s, args.seed)
    if args.url:
        if not args.token:
            raise SystemExit("--token is required with --url")
        server = contextlib.nullcontext(Target(args.url.rstrip("/"), args.token, args.tenant, args.deployment))
    else:
        options = {"model": args.model, "dtype": args.dtype, "device": args.device}
        server = local_server(max(levels), {k: v for k, v in options.items() if v})
    reports = []
    with server as target:
        for level in levels:
            report = asyncio.run(run_level(target, level, max(args.requests, level), args.max_new_tokens, pick,
                                           args.whole))
            logger.info("concurrency %3d: %7.1f tok/s  ttft p50 %7.1f ms p99 %7.1f ms  tpot p50 %6.1f ms "
                        "p99 %6.1f ms  errors %s", level, report.output_tokens_per_s, report.ttft_ms["p50"],
                        report.ttft_ms["p99"], report.tpot_ms["p50"], report.tpot_ms["p99"], report.errors)
            reports.append(report)
    _write(args, target, reports)


def _write(args: argparse.Namespace, target: Target, reports: list[LevelReport]) -> None:
    document = {"deployment": target.deployment, "max_new_tokens": args.max_new_tokens,
                "adapters": args.adapters, "distribution": args.distribution,
                "prompt": PROMPT, "levels": [asdict(r) for r in reports]}
    write_results(document, args.out, time.strftime("serving-%Y%m%d-%H%M%S"), lambda path: plot(reports, path))


if __name__ == "__main__":
    main()
