"""What names a full block of the paged KV cache for prefix caching: a chain of SHA-256 digests.

A block's K/V depend on every token before it, their positions, the adapter that computed them and
that adapter's weights. So the chain starts from the request's KV identity (base model, or the
adapter's whole `AdapterKey`: source, tenant scope, credential digest, version, id, a merge's whole
description; and the serial of the load its weights came from), and block i's digest covers block
i-1's digest and block i's token ids. The identity is encoded as JSON, so no choice of names can
make two identities encode alike (vllm#44701's salt collision); the same prompt under two adapters,
two tenants, two credentials, or one pbase id whose blob was replaced, starts from different roots
and never shares a block. Only a SHA-256 collision could alias two blocks.

Whose blocks a request may reuse is part of the root too (`CacheScope`): its tenant and its
`cache_salt`. A hit is visible to the caller (`cached_tokens`, and the time to the first token), so
a chain shared across tenants would let any tenant test, block by block, whether another has sent
a given prefix. An unsalted base-model chain drops the tenant only when the operator says its
tenants trust each other (`KVCacheConfig.share_base_prefix_cache`); a salted chain never does, so a
salt guessed by another tenant still finds nothing.
"""
from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Sequence

from lora_runtime.adapters.refs import AdapterKey
from lora_runtime.core import CacheScope


def kv_identity(key: AdapterKey | None, load_serial: int | None, scope: CacheScope,
                share_base_across_tenants: bool = False, rope_variant: str | None = None) -> bytes:
    """The root of a request's block chain: its scope (tenant, salt), the rotation its keys take
    (`rope_variant`: LongRoPE's long set for a long prompt, `LlamaModel.rope_variant`), then the base
    model, or its adapter's key and weights' load. With `share_base_across_tenants`, an unsalted
    base-model root names no tenant, so every tenant's unsalted base-model requests share blocks."""
    is_shared = key is None and scope.salt is None and share_base_across_tenants
    tenant = "" if is_shared else scope.tenant
    model = ["base"] if key is None else [
        "adapter", key.source, key.scope, key.credential, key.version, key.adapter_id, load_serial]
    return hashlib.sha256(json.dumps([tenant, scope.salt, rope_variant, *model]).encode()).digest()


def extend_block_hashes(hashes: list[bytes], identity: bytes, token_ids: Sequence[int], num_blocks: int,
                        block_size: int) -> None:
    """Extend `hashes` in place to the first `num_blocks` full blocks of `token_ids`."""
    assert num_blocks * block_size <= len(token_ids), "only full blocks have a hash"
    packer = struct.Struct(f"<{block_size}I")
    while len(hashes) < num_blocks:
        start = len(hashes) * block_size
        parent = hashes[-1] if hashes else identity
        hashes.append(hashlib.sha256(parent + packer.pack(*token_ids[start:start + block_size])).digest())
