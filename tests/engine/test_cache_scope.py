"""Whose cached prompt blocks a request may reuse (`CacheScope`): its tenant's, base model included,
unless the operator shares the base model's across tenants; and within them only those of the same
`cache_salt`. The probe is the attacker's: send another scope's prompt and read `num_cached_tokens`."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from lora_runtime import CacheScope, Engine, SamplingParams
from lora_runtime.adapters.refs import AdapterKey, AdapterRequest, Caller, parse_adapter_ref
from lora_runtime.config import KVCacheConfig
from lora_runtime.core import MAX_CACHE_SALT_CHARS
from lora_runtime.errors import ValidationError
from lora_runtime.prefix_cache import kv_identity

DEMO = Path(__file__).resolve().parents[2] / "demo_adapters"
PARAMS = SamplingParams(max_new_tokens=1, apply_chat_template=True)
A, B = CacheScope("tenant-a"), CacheScope("tenant-b")


def _chat(topic: str) -> str:
    system = f"You keep the confidential {topic} handbook of ACME. " + "Never reveal it. " * 60
    return json.dumps([{"role": "system", "content": system}, {"role": "user", "content": "Hello"}])


def _cached_tokens(engine: Engine, prompt: str | list[int], scope: CacheScope, adapter: object = None) -> int:
    params = PARAMS if isinstance(prompt, str) else dataclasses.replace(PARAMS, apply_chat_template=False)
    return engine.generate([prompt], params, adapters=[adapter], cache_scope=scope)[0].num_cached_tokens


def _adapter(tenant: str) -> AdapterRequest:
    return AdapterRequest(parse_adapter_ref(str(DEMO / "french"), "local", allow_local=True), Caller(tenant))


@pytest.fixture(scope="module")
def scoped(engine) -> Engine:
    return Engine(engine.config, engine.model, engine.tokenizer, engine.model_name)


@pytest.fixture(scope="module")
def sharing(engine) -> Engine:
    """An engine whose operator shares the base model's blocks across tenants."""
    kv_cache = dataclasses.replace(engine.config.kv_cache, share_base_prefix_cache=True)
    config = dataclasses.replace(engine.config, kv_cache=kv_cache)
    return Engine(config, engine.model, engine.tokenizer, engine.model_name)


# The chain's root, without a model.

def test_the_root_names_the_tenant_and_the_salt_for_the_base_model_too() -> None:
    base = kv_identity(None, None, A)
    assert base != kv_identity(None, None, B)
    assert base != kv_identity(None, None, CacheScope("tenant-a", salt="s1"))
    assert kv_identity(None, None, CacheScope("tenant-a", salt="s1")) != kv_identity(
        None, None, CacheScope("tenant-a", salt="s2"))
    assert base == kv_identity(None, None, CacheScope("tenant-a"))
    # A tenant and a salt that would concatenate alike stay apart (the root is encoded, not joined).
    assert kv_identity(None, None, CacheScope("a", salt="b")) != kv_identity(None, None, CacheScope("ab"))


def test_sharing_the_base_model_drops_the_tenant_of_unsalted_base_roots_only() -> None:
    assert kv_identity(None, None, A, True) == kv_identity(None, None, B, True)
    salted = CacheScope("tenant-a", salt="s1")
    assert kv_identity(None, None, salted, True) != kv_identity(None, None, A, True)
    # A salt another tenant guessed finds nothing: salted roots keep their tenant.
    assert kv_identity(None, None, salted, True) != kv_identity(None, None, CacheScope("tenant-b", salt="s1"), True)
    key = AdapterKey("local", "", "", "", "french")  # an adapter key naming no tenant (the library's)
    assert kv_identity(key, 1, A, True) != kv_identity(key, 1, B, True)


@pytest.mark.parametrize("salt", ["", "x" * (MAX_CACHE_SALT_CHARS + 1), 5, b"bytes"],
                         ids=["empty", "too-long", "number", "bytes"])
def test_a_bad_salt_is_refused_by_name(salt: object) -> None:
    with pytest.raises(ValidationError) as refused:
        CacheScope("tenant-a", salt=salt)
    assert refused.value.field == "cache_salt"


def test_the_salt_is_never_quoted_in_a_refusal_or_a_repr() -> None:
    with pytest.raises(ValidationError) as refused:
        CacheScope("tenant-a", salt="s3cr3t" * 50)
    assert "s3cr3t" not in refused.value.message
    secret = "s3cr3t-" + "k" * (MAX_CACHE_SALT_CHARS - 7)  # the bound itself is fine
    assert secret not in repr(CacheScope("tenant-a", salt=secret))


# The engine.

@pytest.mark.parametrize("first, second", [(A, B), (B, A)], ids=["a-then-b", "b-then-a"])
def test_another_tenants_base_model_prompt_is_never_a_hit(scoped, first: CacheScope, second: CacheScope) -> None:
    prompt = _chat(f"{first.tenant} payroll")
    assert _cached_tokens(scoped, prompt, first) == 0
    assert _cached_tokens(scoped, prompt, first) > 200  # the positive control: its own tenant hits
    assert _cached_tokens(scoped, prompt, second) == 0
    assert _cached_tokens(scoped, prompt, second) > 200  # and now the second tenant has its own


def test_a_salt_isolates_requests_from_unsalted_ones_and_from_other_salts(scoped) -> None:
    prompt = _chat("salted")
    salted = CacheScope("tenant-a", salt="user-1-secret")
    assert _cached_tokens(scoped, prompt, A) == 0
    assert _cached_tokens(scoped, prompt, salted) == 0
    assert _cached_tokens(scoped, prompt, salted) > 200  # the same salt shares
    assert _cached_tokens(scoped, prompt, CacheScope("tenant-a", salt="user-2-secret")) == 0
    assert _cached_tokens(scoped, prompt, CacheScope("tenant-b", salt="user-1-secret")) == 0
    assert _cached_tokens(scoped, prompt, A) > 200  # the unsalted chain is still its own


def test_a_shared_base_model_cache_shares_across_tenants_but_never_an_adapters(sharing) -> None:
    prompt = _chat("shared")
    assert _cached_tokens(sharing, prompt, A) == 0
    assert _cached_tokens(sharing, prompt, B) > 200
    assert _cached_tokens(sharing, prompt, CacheScope("tenant-b", salt="s1")) == 0  # a salt still isolates
    assert _cached_tokens(sharing, prompt, CacheScope("tenant-b", salt="s1")) > 200  # the same salt shares
    assert _cached_tokens(sharing, prompt, CacheScope("tenant-a", salt="s1")) == 0  # in its tenant only
    assert _cached_tokens(sharing, prompt, A, _adapter("tenant-a")) == 0
    assert _cached_tokens(sharing, prompt, B, _adapter("tenant-b")) == 0


def test_best_of_candidates_cache_their_tokens_in_their_requests_scope(scoped) -> None:
    """Candidates forked from the first one register the blocks they generate under the request's
    scope: that scope finds each candidate's whole text again, another finds none of it."""
    params = SamplingParams(max_new_tokens=40, apply_chat_template=True, best_of=2, do_sample=True, seed=3,
                            ignore_eos_token=True)
    output = scoped.generate([_chat("best of")], params, cache_scope=A)[0]
    block = scoped.kv_cache.block_size_tokens
    for index, sequence in enumerate([output, *output.best_of_sequences]):
        probe = output.prompt_token_ids + sequence.token_ids[:-1]  # the last token's K/V were never computed
        assert _cached_tokens(scoped, probe, A) == (len(probe) - 1) // block * block
        assert _cached_tokens(scoped, probe, CacheScope(f"prober-{index}")) == 0
