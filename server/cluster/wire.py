"""What crosses between the ingress and an engine replica: the replica's first word on a request
(accepted, and by whom, or refused with the engine's error), its outputs, a failure after that, the
replica's published state, and the multiplexed model id that names an adapter."""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

from lora_runtime.api import AdapterKey, EngineError, EngineStats, RequestOutput


@dataclass(frozen=True, slots=True)
class Accepted:
    """The request is validated and queued on `replica_id`; its outputs follow."""

    replica_id: str
    request_id: str


@dataclass(frozen=True, slots=True)
class Outputs:
    """The request's outputs that were ready when the replica sent (one or more, in order): one Ray
    message for them all, where a busy ingress or replica would otherwise send one a token."""

    outputs: tuple[RequestOutput, ...]


@dataclass(frozen=True, slots=True)
class Failed:
    """The request failed on its replica, before or after `Accepted`; nothing follows."""

    error: EngineError


@dataclass(frozen=True, slots=True)
class ReplicaReport:
    """A replica's state as it published it: its engine's stats and the adapters its host cache holds
    (the cluster view of `GET /cluster`). `age_s` is set by the directory as it hands the report out:
    seconds since it received it, on its own clock (replicas' clocks may differ)."""

    replica_id: str
    stats: EngineStats
    cached_adapters: tuple[AdapterKey, ...]
    age_s: float = 0.0


def adapter_model_id(key: AdapterKey) -> str:
    """The multiplexed model id of an adapter: readable, and distinct for every distinct key (tenant,
    credential and version included), as the engine's caches are."""
    fields = [key.source, key.scope, key.credential, key.version, key.adapter_id]
    digest = hashlib.sha256(json.dumps(fields).encode()).hexdigest()[:16]
    return f"{key}#{digest}"
