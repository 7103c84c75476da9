"""Measures one request on an adapter the engine has not loaded yet, in a process of its own with every
core of the machine (no pinning inherited from pytest, which can hide a thread starving another of the
GIL), and prints the figures as one JSON line. Run by tests/engine/test_cold_adapter_wait.py:

    python -m tests.engine.cold_adapter_probe {sync|async} ADAPTER_DIR...

`sync` drives `Engine.generate`'s loop (the engine thread is the main thread); `async` an `AsyncEngine`
(the engine thread is its loop thread). Printed, one entry per adapter (each cold, in turn): `seconds`
(acquire to the finished answer), `wait_seconds` (acquire to the load settling) and `wait_cpu_seconds`
(the engine thread's CPU time meanwhile).
"""
from __future__ import annotations

import os

os.sched_setaffinity(0, range(os.cpu_count() or 1))  # before torch sizes its thread pool by it

import asyncio  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402

from lora_runtime import Engine, EngineConfig, SamplingParams  # noqa: E402
from lora_runtime.async_engine import AsyncEngine  # noqa: E402
from lora_runtime.embedded import ensure_embedded_model  # noqa: E402

PROMPT = "Hello"
ONE_TOKEN = SamplingParams(max_new_tokens=1)


def measure_sync(engine: Engine, adapter_dir: str) -> dict[str, float]:
    start, cpu_start = time.monotonic(), time.thread_time()
    lease = engine.adapters.acquire(engine.adapters.parse(adapter_dir))
    request_id = engine.add_request(PROMPT, ONE_TOKEN, lease)
    while not lease.load.done():
        engine.step()
    wait_seconds, wait_cpu_seconds = time.monotonic() - start, time.thread_time() - cpu_start
    finished = False
    while not finished:
        finished = any(output.finished for output in engine.step() if output.request_id == request_id)
    return {"seconds": time.monotonic() - start, "wait_seconds": wait_seconds, "wait_cpu_seconds": wait_cpu_seconds}


async def measure_async(engine: Engine, adapter_dirs: list[str]) -> list[dict[str, float]]:
    front = AsyncEngine(engine)
    await front.start()
    loop_thread = next(thread for thread in threading.enumerate() if thread.name == "engine-loop")
    clock = time.pthread_getcpuclockid(loop_thread.ident)
    figures = [await _measure_one_async(front, clock, adapter_dir) for adapter_dir in adapter_dirs]
    await front.shutdown()
    return figures


async def _measure_one_async(front: AsyncEngine, clock: int, adapter_dir: str) -> dict[str, float]:
    adapters = front.engine.adapters
    start, cpu_start = time.monotonic(), time.clock_gettime(clock)
    # A second hold on the same load (it joins the one the request starts): to see when it settles.
    watch = adapters.acquire(adapters.parse(adapter_dir))
    answer = asyncio.create_task(_answer(front, adapter_dir))
    await asyncio.wrap_future(watch.load)
    wait_seconds, wait_cpu_seconds = time.monotonic() - start, time.clock_gettime(clock) - cpu_start
    await answer
    seconds = time.monotonic() - start
    watch.release()
    return {"seconds": seconds, "wait_seconds": wait_seconds, "wait_cpu_seconds": wait_cpu_seconds}


async def _answer(front: AsyncEngine, adapter_dir: str) -> None:
    async for output in await front.add_request(PROMPT, ONE_TOKEN, adapter_dir):
        assert output.error is None, output.error


def main(mode: str, adapter_dirs: list[str]) -> None:
    # The Hugging Face directory the adapters were made for: the wait is measured, not the default GGUF.
    engine = Engine.from_config(EngineConfig(model=str(ensure_embedded_model())))
    engine.generate([PROMPT], ONE_TOKEN)  # warm: the base model's first step is not what is measured
    if mode == "sync":
        figures = [measure_sync(engine, adapter_dir) for adapter_dir in adapter_dirs]
    else:
        figures = asyncio.run(measure_async(engine, adapter_dirs))
    print(json.dumps({"cpus": sorted(os.sched_getaffinity(0)), "adapters": figures}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
