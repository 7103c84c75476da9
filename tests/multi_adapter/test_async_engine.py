"""`AsyncEngine`'s streams: a caller of `add_request` cancelled while its request waits for the loop
thread (a client that leaves, an ingress that gives up) costs nothing and never stops the loop (the
request is not queued, its adapter hold is released); `final_only` yields the finished output alone;
the loop thread runs on the CPUs it is given."""
from __future__ import annotations

import asyncio
import os
import threading

from lora_runtime import AsyncEngine, SamplingParams
from tests.multi_adapter.conftest import make_engine


def test_a_cancelled_add_is_dropped_and_the_loop_keeps_serving(tiny_dir, adapter_dirs) -> None:
    async def run() -> tuple:
        engine = AsyncEngine(make_engine(tiny_dir))
        await engine.start()
        try:
            holding, gate = threading.Event(), threading.Event()

            def hold() -> None:  # the loop thread, held until the request's command is behind it
                holding.set()
                gate.wait()

            engine._commands.put(hold)
            await asyncio.to_thread(holding.wait)
            params = SamplingParams(max_new_tokens=2, ignore_eos_token=True)
            pending = asyncio.create_task(engine.add_request([5, 17, 33], params, str(adapter_dirs["q_v_r8"])))
            while engine._commands.empty():  # the adapter loaded and its add queued behind the gate
                await asyncio.sleep(0.01)
            pending.cancel()
            await asyncio.sleep(0)
            gate.set()
            async def serve_another() -> list:
                return [output async for output in await engine.add_request([5, 17, 33], params)]

            outputs = await asyncio.wait_for(serve_another(), 60)  # a dead loop would never answer
            return pending.cancelled(), outputs[-1], engine.is_running, engine.stats()
        finally:
            await engine.shutdown()

    cancelled, last, is_running, stats = asyncio.run(run())
    assert cancelled and is_running
    assert last.finished and len(last.token_ids) == 2
    assert stats.num_finished_requests == 1  # the cancelled request never ran
    assert stats.num_pinned_adapters == 0  # and its adapter hold was released


def test_final_only_yields_the_finished_output_alone(tiny_dir) -> None:
    async def run() -> tuple:
        engine = AsyncEngine(make_engine(tiny_dir))
        await engine.start()
        try:
            params = SamplingParams(max_new_tokens=5, ignore_eos_token=True)
            every = [output async for output in await engine.add_request([5, 17, 33], params)]
            final = [output async for output in await engine.add_request([5, 17, 33], params, final_only=True)]
            return every, final
        finally:
            await engine.shutdown()

    every, final = asyncio.run(run())
    assert len(every) == 5 and [output.finished for output in final] == [True]
    assert final[0].token_ids == every[-1].token_ids


def test_the_engine_loop_runs_on_its_cpus_and_the_callers_threads_keep_theirs(tiny_dir) -> None:
    allowed = sorted(os.sched_getaffinity(0))

    async def run() -> tuple[set[int], list[int]]:
        engine = AsyncEngine(make_engine(tiny_dir), cpus={allowed[-1]})
        await engine.start()
        try:
            params = SamplingParams(max_new_tokens=2, ignore_eos_token=True)
            outputs = [output async for output in await engine.add_request([5, 17, 33], params)]
            return os.sched_getaffinity(engine._thread.native_id), outputs[-1].token_ids
        finally:
            await engine.shutdown()

    loop_cpus, token_ids = asyncio.run(run())
    assert loop_cpus == {allowed[-1]} and len(token_ids) == 2
    assert sorted(os.sched_getaffinity(0)) == allowed
