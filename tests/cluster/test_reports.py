"""The replicas' reports without a Ray instance: the directory keeps each replica's latest and
forgets silent ones; the cluster's stats are the replicas' summed, its KV usage that of all blocks."""
from __future__ import annotations

import dataclasses
import time

import pytest

from lora_runtime.adapters.refs import AdapterKey
from lora_runtime.api import EngineStats
from server.cluster.remote import sum_stats
from server.cluster.replica import ReplicaDirectory
from server.cluster.wire import ReplicaReport, adapter_model_id

KEY_A = AdapterKey("pbase", "demo", "", "blob-1", "a/1")
KEY_B = AdapterKey("pbase", "other", "", "blob-2", "a/1")


def _stats(free: int, total: int, running: int, adapters: tuple[AdapterKey, ...]) -> EngineStats:
    values = {field.name: 0 for field in dataclasses.fields(EngineStats)}
    values.update(num_free_blocks=free, num_total_blocks=total, num_running=running,
                  kv_cache_usage_ratio=1 - free / total, running_adapters=adapters, waiting_adapters=())
    return EngineStats(**values)


def test_the_cluster_sums_its_replicas() -> None:
    total = sum_stats([_stats(90, 100, 2, (KEY_A,)), _stats(10, 300, 3, (KEY_A, KEY_B))])
    assert (total.num_running, total.num_total_blocks, total.num_free_blocks) == (5, 400, 100)
    assert total.kv_cache_usage_ratio == pytest.approx(300 / 400)
    assert total.running_adapters == (KEY_A, KEY_B)
    assert sum_stats([]).num_running == 0


def test_the_directory_keeps_the_latest_report_and_forgets_silent_replicas() -> None:
    directory = ReplicaDirectory()
    directory.publish(ReplicaReport("r1", _stats(1, 2, 0, ()), ()))
    directory.publish(ReplicaReport("r2", _stats(1, 2, 0, ()), ()))
    directory.publish(ReplicaReport("r1", _stats(1, 2, 7, ()), (KEY_A,)))
    reports = directory.reports(max_age_s=60)
    assert [(r.replica_id, r.stats.num_running) for r in reports] == [("r1", 7), ("r2", 0)]
    assert all(0 <= r.age_s < 60 for r in reports)
    time.sleep(0.05)
    assert directory.reports(max_age_s=0.01) == []


def test_an_adapter_model_id_tells_apart_what_the_engine_caches_apart() -> None:
    ids = {adapter_model_id(key) for key in (KEY_A, KEY_B, dataclasses.replace(KEY_A, version="blob-9"),
                                             dataclasses.replace(KEY_A, credential="c"))}
    assert len(ids) == 4
    assert adapter_model_id(KEY_A).startswith("demo/pbase:a/1#")
