"""Eviction under pressure never serves the wrong weights: through a device pool that holds two
small adapters at once and a host cache that holds one, the same pbase id under two tenants, and one
tenant's id whose version is replaced, each serve exactly what their own directory serves alone, in
the same batch and again after being evicted and reloaded."""
from __future__ import annotations

from pathlib import Path

import torch

from lora_runtime import SamplingParams
from lora_runtime.adapters.page_tensors import bytes_per_page
from lora_runtime.adapters.refs import AdapterRef, AdapterRequest, Caller, parse_adapter_ref
from lora_runtime.config import AdapterConfig
from tests.adapters.peft_factory import tiny_shape
from tests.multi_adapter.conftest import make_engine

PROMPTS = [[5, 17, 33, 9], [60, 2, 77, 8, 14], [21, 3, 90], [44, 45, 46, 47, 48, 49]]
PARAMS = SamplingParams(max_new_tokens=4, ignore_eos_token=True)


class TenantRepos:
    """A pbase-like source: each (tenant, repo) names a directory, and a new version replaces it."""

    def __init__(self) -> None:
        self.current: dict[tuple[str, str], str] = {}

    def resolve(self, ref: AdapterRef, caller: Caller) -> Path:
        return Path(self.current[(caller.scope, ref.name)])


def test_same_id_two_tenants_and_a_replaced_version_never_share_weights(tiny_dir, adapter_dirs) -> None:
    repos = TenantRepos()
    one_page = bytes_per_page(tiny_shape(), torch.float32)
    engine = make_engine(tiny_dir, AdapterConfig(max_rank=16, device_pool_bytes=2 * one_page, host_cache_bytes=1),
                         sources={"pbase": repos})
    reference = make_engine(tiny_dir)
    alone = {name: [reference.generate([p], PARAMS, adapters=[str(adapter_dirs[name])])[0].token_ids for p in PROMPTS]
             for name in ("q_v_r8", "all_linear_r4", "patterns", "rslora_r16")}

    def request(tenant: str, version: str) -> AdapterRequest:
        return AdapterRequest(parse_adapter_ref("shared/1", allow_local=False), Caller(tenant), version)

    def serve(tenants: dict[str, tuple[str, str]]) -> dict[str, list[list[int]]]:
        """Every prompt once per tenant, all in one batch; tenant -> (version key, served directory)."""
        for tenant, (_, name) in tenants.items():
            repos.current[(tenant, "shared")] = str(adapter_dirs[name])
        adapters = [request(tenant, version) for tenant, (version, _) in tenants.items() for _ in PROMPTS]
        outputs = engine.generate(PROMPTS * len(tenants), PARAMS, adapters=adapters)
        assert all(o.error is None for o in outputs), [o.error for o in outputs]
        tokens = [o.token_ids for o in outputs]
        return {tenant: tokens[i * len(PROMPTS):(i + 1) * len(PROMPTS)] for i, tenant in enumerate(tenants)}

    first = serve({"alice": ("v1", "q_v_r8"), "bob": ("v1", "all_linear_r4"), "carol": ("v1", "patterns")})
    assert first == {"alice": alone["q_v_r8"], "bob": alone["all_linear_r4"], "carol": alone["patterns"]}
    # alice's repo gets a new version: same id, new content, new key; bob's is evicted and placed again.
    second = serve({"alice": ("v2", "rslora_r16"), "bob": ("v1", "all_linear_r4"), "carol": ("v1", "patterns")})
    assert second == {"alice": alone["rslora_r16"], "bob": alone["all_linear_r4"], "carol": alone["patterns"]}
    assert engine.adapters.pages.num_resident <= 2 and engine.adapters.pages.num_pinned == 0
