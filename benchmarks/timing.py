"""Wall and CPU time of a block, for the benchmarks.

On a shared machine the CPU time of a single-threaded run is the figure that repeats, so throughput
is reported per CPU-second as well as per wall second, and ratios are taken on CPU time."""
from __future__ import annotations

import resource
import time
from pathlib import Path


class Timer:
    def __enter__(self) -> "Timer":
        self.wall, self.cpu = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc) -> None:
        self.wall, self.cpu = time.perf_counter() - self.wall, time.process_time() - self.cpu

    def report(self, num_tokens: int) -> dict:
        return {"tokens": num_tokens, "wall_s": self.wall, "cpu_s": self.cpu,
                "tokens_per_s": num_tokens / self.wall, "tokens_per_cpu_s": num_tokens / self.cpu}


def rss_mib() -> float:
    """The process's resident memory now (Linux; the peak elsewhere)."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
    except OSError:
        return peak_rss_mib()
    return pages * resource.getpagesize() / 2**20


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
