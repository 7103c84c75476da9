"""Prefix caching: blocks reused only under the same adapter identity, kept until memory is needed,
and outputs equal to a cache-less engine's (the oracle) under eviction and preemption."""
from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path

import pytest

from lora_runtime import Engine, SamplingParams
from lora_runtime.adapters.refs import AdapterKey, AdapterRequest, Caller, parse_adapter_ref
from lora_runtime.config import KVCacheConfig
from lora_runtime.core import CacheScope
from lora_runtime.kv_cache import KVCacheManager
from lora_runtime.prefix_cache import extend_block_hashes, kv_identity

DEMO = Path(__file__).resolve().parents[2] / "demo_adapters"
SYSTEM = {name: f"You answer for the {name} desk of ACME. " + "Policies apply to every answer. " * 40
          for name in ("base", "french", "shout")}
NO_SCOPE = CacheScope()  # the library's one caller
PARAMS = SamplingParams(max_new_tokens=6, apply_chat_template=True, ignore_eos_token=True)


def _chat(desk: str, question: str) -> str:
    return json.dumps([{"role": "system", "content": SYSTEM[desk]}, {"role": "user", "content": question}])


def _engine(shared: Engine, **kv_cache) -> Engine:
    config = dataclasses.replace(shared.config, kv_cache=KVCacheConfig(**kv_cache))
    return Engine(config, shared.model, shared.tokenizer, shared.model_name)


def _local(name: str, scope: str = "", token: str | None = None, version: str = "") -> AdapterRequest:
    ref = parse_adapter_ref(str(DEMO / name), "local", allow_local=True)
    return AdapterRequest(ref, Caller(scope, token), version)


def _cached_tokens(engine: Engine, prompt: str, adapter: object) -> int:
    return engine.generate([prompt], PARAMS, adapters=[adapter])[0].num_cached_tokens


# The allocator and the hash chain, without a model.

def test_released_blocks_stay_cached_until_free_blocks_run_out_then_oldest_first() -> None:
    manager = KVCacheManager(num_blocks=4, block_size_tokens=2, enable_prefix_caching=True)
    hashes = {name: [] for name in "ab"}
    for name, tokens in (("a", [1, 2, 3, 4]), ("b", [5, 6, 7, 8])):
        extend_block_hashes(hashes[name], kv_identity(None, None, NO_SCOPE), tokens, 2, 2)
        assert manager.allocate_slots(name, 4)
        manager.register_full_blocks(name, hashes[name])
        manager.free(name)
    assert (manager.num_free_blocks, manager.allocator.num_cached_blocks) == (4, 4)
    assert manager.match_prefix("a2", hashes["a"], 5) == 2  # a's blocks, back from the cache
    manager.free("a2")  # now the most recently released
    assert manager.allocate_slots("c", 4)  # takes b's blocks: released before a's
    assert manager.allocator.num_evictions == 2
    assert manager.match_prefix("b2", hashes["b"], 5) == 0
    assert manager.match_prefix("a3", hashes["a"], 5) == 2
    assert manager.num_free_blocks == 0


def test_a_shared_cached_block_returns_to_the_cache_only_when_its_last_holder_leaves() -> None:
    manager = KVCacheManager(num_blocks=2, block_size_tokens=2, enable_prefix_caching=True)
    chain: list[bytes] = []
    extend_block_hashes(chain, kv_identity(None, None, NO_SCOPE), [1, 2], 1, 2)
    assert manager.allocate_slots("first", 2)
    manager.register_full_blocks("first", chain)
    assert manager.match_prefix("second", chain, 3) == 1
    manager.free("first")
    assert manager.num_free_blocks == 1  # the shared block is still held by `second`
    manager.free("second")
    assert manager.num_free_blocks == 2 and manager.allocator.num_cached_blocks == 1


@pytest.mark.parametrize("other", [
    AdapterKey("local", "tenant-b", "", "", "x"),  # another tenant
    AdapterKey("local", "tenant-a", "digest-2", "", "x"),  # another credential
    AdapterKey("local", "tenant-a", "", "blob-2", "x"),  # a replaced version
    AdapterKey("local", "tenant-a", "", "", "y"),  # another adapter
    AdapterKey("hub", "tenant-a", "", "", "x"),  # another source
    None,  # the base model
], ids=["tenant", "credential", "version", "adapter", "source", "base"])
def test_every_field_of_the_adapter_identity_roots_its_own_chain(other: AdapterKey | None) -> None:
    key = AdapterKey("local", "tenant-a", "", "", "x")
    assert kv_identity(key, 1, NO_SCOPE) != kv_identity(other, 1, NO_SCOPE)
    assert kv_identity(key, 1, NO_SCOPE) != kv_identity(key, 2, NO_SCOPE)  # the adapter's weights loaded again
    # Names that would concatenate alike stay apart (the identity is encoded, not joined).
    assert (kv_identity(AdapterKey("local", "a", "", "", "b/c"), 1, NO_SCOPE)
            != kv_identity(AdapterKey("local", "a/b", "", "", "c"), 1, NO_SCOPE))


# The engine.

@pytest.fixture(scope="module")
def cached(engine) -> Engine:
    return _engine(engine)


def test_the_same_prompt_under_another_identity_never_reuses_a_block(cached) -> None:
    prompt = _chat("french", "Where is Lyon?")
    first = _cached_tokens(cached, prompt, _local("french", scope="a"))
    again = _cached_tokens(cached, prompt, _local("french", scope="a"))
    assert first == 0 and again > 200  # the positive control: the same identity hits
    for other in (_local("french", scope="b"),  # another tenant, same adapter id
                  _local("french", scope="a", token="hf_other"),  # another credential
                  _local("french", scope="a", version="blob-2"),  # the version replaced
                  _local("shout", scope="a"),  # another adapter
                  None):  # the base model
        assert _cached_tokens(cached, prompt, other) == 0, other


def test_a_reloaded_adapter_does_not_meet_the_old_loads_kv(engine) -> None:
    """With a host cache too small to keep an adapter once its request ends, each request reads
    the adapter's files again: its K/V stay cached but the new load never reuses them."""
    config = dataclasses.replace(engine.config, adapters=dataclasses.replace(engine.config.adapters, host_cache_bytes=1))
    forgetful = Engine(config, engine.model, engine.tokenizer, engine.model_name)
    prompt = _chat("shout", "Where is Nice?")
    assert _cached_tokens(forgetful, prompt, str(DEMO / "shout")) == 0
    assert forgetful.kv_cache.allocator.num_cached_blocks > 10
    assert _cached_tokens(forgetful, prompt, str(DEMO / "shout")) == 0
    assert _cached_tokens(forgetful, prompt, None) == 0
    assert _cached_tokens(forgetful, prompt, None) > 200  # the base model's own K/V are reused


def test_outputs_equal_a_cacheless_engine_under_eviction_and_preemption(engine) -> None:
    """A mixed workload over three identities with shared system prompts, on a KV cache too small
    for the batch (preemption) and for everything cached (eviction)."""
    rng = random.Random(0)
    questions = ["Where is Paris?", "What is rain?", "Name a fruit.", "Count to three.", "Why is ice cold?"]
    desks = {"base": None, "french": str(DEMO / "french"), "shout": str(DEMO / "shout")}
    workload = [(desk, rng.choice(questions)) for desk in rng.choices(list(desks), k=18)]
    prompts = [_chat(desk, question) for desk, question in workload]
    adapters = [desks[desk] for desk, _ in workload]
    params = [dataclasses.replace(PARAMS, max_new_tokens=24, decoder_input_details=i % 5 == 0)
              for i in range(len(prompts))]
    small = {"num_blocks": 90}  # ~360-token prompts: 23 blocks each, so about 4 requests fit at once
    without = _engine(engine, enable_prefix_caching=False, **small).generate(prompts, params, adapters)
    with_cache = _engine(engine, **small)
    outputs = []
    for start in range(0, len(prompts), 6):  # waves, so later ones find what earlier ones cached
        outputs += with_cache.generate(prompts[start:start + 6], params[start:start + 6], adapters[start:start + 6])
    assert with_cache.scheduler.num_preemptions > 0
    assert with_cache.kv_cache.allocator.num_evictions > 0
    assert sum(o.num_cached_tokens for o in outputs) > 0
    for expected, output in zip(without, outputs):
        assert output.token_ids == expected.token_ids
        # Chunk boundaries differ with a hit, so the matmuls' shapes differ: equal to fp32 rounding.
        assert [t.logprob for t in output.tokens] == pytest.approx([t.logprob for t in expected.tokens], abs=1e-4)
        assert [t.logprob for t in output.prefill] == pytest.approx([t.logprob for t in expected.prefill], abs=1e-4)


def test_best_of_forks_and_cache_hits_share_blocks_through_one_count(cached) -> None:
    prompt = _chat("base", "Invent a name for a cat.")
    params = SamplingParams(max_new_tokens=4, apply_chat_template=True, best_of=3, do_sample=True, seed=1)
    first = cached.generate([prompt], params)[0]
    second = cached.generate([prompt], params)[0]
    assert second.num_cached_tokens > 200
    assert second.token_ids == first.token_ids  # seeded: the cache changed nothing
    assert cached.kv_cache.num_free_blocks == cached.kv_cache.num_blocks  # every reference returned
