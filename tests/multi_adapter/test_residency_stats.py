"""The engine's stats (the server's `lora_engine_*` gauges) show each adapter tier: loaded in the
host cache, pinned by requests in flight, and resident in the device pool's pages."""
from __future__ import annotations

import asyncio

from lora_runtime import AsyncEngine, SamplingParams
from tests.multi_adapter.conftest import make_engine


def test_stats_count_cached_pinned_and_resident_adapters(tiny_dir, adapter_dirs) -> None:
    async def run() -> tuple:
        engine = AsyncEngine(make_engine(tiny_dir))
        await engine.start()
        try:
            before = engine.stats()
            params = SamplingParams(max_new_tokens=2, ignore_eos_token=True)
            streams = [await engine.add_request([5, 17, 33], params, str(adapter_dirs[name]))
                       for name in ("q_v_r8", "rslora_r16")]
            for stream in streams:
                async for _ in stream:
                    pass
            return before, engine.stats(), engine.cached_adapters()
        finally:
            await engine.shutdown()

    before, after, cached = asyncio.run(run())
    assert (before.num_resident_adapters, before.num_cached_adapters) == (0, 0)
    assert before.num_free_adapter_pages == before.num_total_adapter_pages > 0
    assert after.num_cached_adapters == after.num_resident_adapters == 2 and after.num_pinned_adapters == 0
    # Two adapters of rank <= 16, one page each in the modules they adapt; both stay resident while idle.
    assert after.num_free_adapter_pages == after.num_total_adapter_pages - 1
    # What a cluster replica reports it holds: the host cache's keys, the two adapters' paths.
    assert sorted(key.adapter_id for key in cached) == sorted(str(adapter_dirs[name]) for name in ("q_v_r8", "rslora_r16"))
