"""The CPU memory budget (lora_runtime/memory_budget.py) against checkpoints built here: the weights'
bytes against the tensors safetensors itself loads, the KV cache the engine allocates against the
budget's, the refusal before any weight is read, and the memory available read from files."""
from __future__ import annotations

from pathlib import Path

import pytest
from safetensors.torch import load_file
from transformers import AutoTokenizer

import kernels
from lora_runtime.config import AdapterConfig, EngineConfig, KVCacheConfig, SchedulerConfig
from lora_runtime.embedded import ensure_embedded_model
from lora_runtime.engine import Engine
from lora_runtime.loader import load_model
from lora_runtime.memory_budget import (MIB, MemoryBudgetError, available_memory_bytes, cgroup_headroom_bytes,
                                        checkpoint_weights_bytes, memory_budget_for)
from tests.engine.factories import save_tiny_model

GIB = 1024 * MIB
SMALL_POOLS = AdapterConfig(device_pool_bytes=8 * MIB, host_cache_bytes=8 * MIB)


@pytest.fixture(scope="module")
def sharded_dir(tmp_path_factory) -> Path:
    """A tiny Llama saved in shards with an index, as real checkpoints at size are."""
    directory = tmp_path_factory.mktemp("sharded")
    model = save_tiny_model("llama", directory)
    model.save_pretrained(directory, safe_serialization=True, max_shard_size="40KB")
    assert (directory / "model.safetensors.index.json").is_file()
    return directory


def _loaded_bytes(directory: Path, itemsize: int) -> int:
    return sum(tensor.numel() * itemsize for file in directory.glob("*.safetensors")
               for tensor in load_file(file).values())


def test_weights_bytes_from_the_headers_equal_the_tensors_loaded(sharded_dir: Path) -> None:
    assert len(list(sharded_dir.glob("*.safetensors"))) > 1
    assert checkpoint_weights_bytes(sharded_dir, "float32") == _loaded_bytes(sharded_dir, 4)
    assert checkpoint_weights_bytes(sharded_dir, "bfloat16") == _loaded_bytes(sharded_dir, 2)


def _engine(directory: Path, kv_cache: KVCacheConfig, scheduler: SchedulerConfig = SchedulerConfig()) -> Engine:
    config = EngineConfig(model=str(directory), dtype="float32", adapters=SMALL_POOLS, kv_cache=kv_cache,
                          scheduler=scheduler)
    model = load_model(directory, "float32", "cpu", kernels.backend_for("cpu"))
    return Engine(config, model, AutoTokenizer.from_pretrained(ensure_embedded_model()), "tiny")


def _cache_bytes(engine: Engine) -> int:
    tensors = engine.runner.cache_tensors
    return sum(tensor.nbytes for tensor in tensors.key + tensors.value)


def test_the_cache_takes_the_memory_left_after_weights_pools_and_overhead(sharded_dir: Path) -> None:
    unbounded = memory_budget_for(EngineConfig(model=str(sharded_dir), adapters=SMALL_POOLS,
                                               kv_cache=KVCacheConfig(available_memory_bytes=64 * GIB)),
                                  sharded_dir, "float32")
    fixed = unbounded.weights_bytes + unbounded.adapter_pool_bytes + unbounded.overhead_bytes
    available = fixed + unbounded.kv_cache_bytes // 2 + 12345  # less than the model could use
    engine = _engine(sharded_dir, KVCacheConfig(available_memory_bytes=available, host_memory_utilization=1.0))
    budget = engine.memory_budget
    assert budget.weights_bytes == _loaded_bytes(sharded_dir, 4)
    assert budget.adapter_pool_bytes == 16 * MIB and budget.available_bytes == available
    assert budget.total_bytes == available  # all of it, since the model could use more than is left
    block_bytes = _cache_bytes(engine) // engine.kv_cache.num_blocks
    assert budget.kv_cache_bytes - block_bytes < _cache_bytes(engine) <= budget.kv_cache_bytes
    assert engine.info.memory_budget == budget


def test_the_cache_is_bounded_by_what_the_model_can_use(sharded_dir: Path) -> None:
    scheduler = SchedulerConfig(max_num_seqs=3)
    engine = _engine(sharded_dir, KVCacheConfig(available_memory_bytes=64 * GIB), scheduler)
    per_token = 2 * 2 * 2 * 16 * 4  # layers, keys and values, kv heads, head_dim, float32
    assert engine.memory_budget.kv_cache_bytes == 3 * 256 * per_token
    assert engine.kv_cache.num_blocks * 16 == 3 * 256


def test_a_given_size_wins_over_the_memory_left(sharded_dir: Path) -> None:
    engine = _engine(sharded_dir, KVCacheConfig(memory_bytes=MIB, available_memory_bytes=64 * GIB))
    assert engine.memory_budget.kv_cache_bytes == MIB
    assert _cache_bytes(engine) == MIB


def test_a_model_that_does_not_fit_is_refused_with_the_numbers_before_a_weight_is_read(sharded_dir: Path,
                                                                                       tmp_path: Path) -> None:
    unreadable = tmp_path / "unreadable"
    unreadable.mkdir()
    for file in sharded_dir.iterdir():
        data = file.read_bytes()
        if file.suffix == ".safetensors":  # the header alone: reading any tensor would fail
            data = data[: 8 + int.from_bytes(data[:8], "little")]
        (unreadable / file.name).write_bytes(data)
    config = EngineConfig(model=str(unreadable), dtype="float32", adapters=SMALL_POOLS,
                          kv_cache=KVCacheConfig(available_memory_bytes=300 * MIB))
    with pytest.raises(MemoryBudgetError) as refused:
        Engine.from_config(config)
    message = str(refused.value)
    assert f"weights {_loaded_bytes(sharded_dir, 4) / MIB:.0f} MiB" in message and "adapter pools 16 MiB" in message and "300 MiB available" in message
    assert "smallest KV cache" in message


def test_gguf_weights_count_block_types_as_stored_and_dense_ones_in_the_dtype(tmp_path: Path) -> None:
    from tests.engine.gguf_factory import PROJECTIONS, VOCAB_SIZE, TinyDims, random_tensors, write_gguf

    dims = TinyDims()
    q8_0 = {name: "Q8_0" for name in (*PROJECTIONS, "token_embd", "output")}
    path = write_gguf(tmp_path / "tiny.gguf", dims, random_tensors(dims, q8_0))
    projections = sum(dims.num_layers * rows * cols for rows, cols in map(dims.projection_shape, PROJECTIONS))
    norms = (2 * dims.num_layers + 1) * dims.hidden_size
    embedding = output = VOCAB_SIZE * dims.hidden_size  # Q8_0: 34 bytes a block of 32 (looked up by row)
    expected = (projections + output + embedding) * 34 // 32 + norms * 2
    config = EngineConfig(model=str(path), kv_cache=KVCacheConfig(memory_bytes=MIB))
    assert memory_budget_for(config, path, "bfloat16").weights_bytes == expected


def test_cgroup_v2_headroom_is_its_limit_less_its_usage(tmp_path: Path) -> None:
    (tmp_path / "memory.max").write_text("1073741824\n")
    (tmp_path / "memory.current").write_text("73741824\n")
    assert cgroup_headroom_bytes(tmp_path) == 1_000_000_000
    (tmp_path / "memory.max").write_text("max\n")
    assert cgroup_headroom_bytes(tmp_path) is None


def test_cgroup_v1_headroom_and_its_unlimited_value(tmp_path: Path) -> None:
    (tmp_path / "memory.limit_in_bytes").write_text("2147483648\n")
    (tmp_path / "memory.usage_in_bytes").write_text("147483648\n")
    assert cgroup_headroom_bytes(tmp_path) == 2_000_000_000
    (tmp_path / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    assert cgroup_headroom_bytes(tmp_path) is None
    assert cgroup_headroom_bytes(tmp_path / "absent") is None


def test_memory_available_is_the_smaller_of_meminfo_and_the_cgroup(tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24684092 kB\nMemFree:        16404136 kB\nMemAvailable:    4000000 kB\n")
    v2, v1 = tmp_path / "v2", tmp_path / "v1"
    v2.mkdir(), v1.mkdir()
    assert available_memory_bytes(meminfo, (v2, v1)) == 4_000_000 * 1024
    (v1 / "memory.limit_in_bytes").write_text("3000000000\n")
    (v1 / "memory.usage_in_bytes").write_text("1000000000\n")
    assert available_memory_bytes(meminfo, (v2, v1)) == 2_000_000_000


def test_the_budget_fits_the_machine_it_runs_on(sharded_dir: Path) -> None:
    budget = memory_budget_for(EngineConfig(model=str(sharded_dir), adapters=SMALL_POOLS), sharded_dir, "float32")
    assert 0 < budget.total_bytes <= budget.available_bytes


def test_a_directory_without_a_config_is_refused_by_name_before_the_budget(tmp_path: Path) -> None:
    from lora_runtime.errors import ValidationError

    with pytest.raises(ValidationError, match="no config.json"):
        Engine.from_config(EngineConfig(model=str(tmp_path / "absent")))
