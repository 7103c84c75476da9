"""`benchmarks.quantized` and its 1B-shape run (`benchmarks.quantized_floor`): the command starts, the
bytes a decode step reads are the checkpoint's projection and head bytes (read from its header, the
outside oracle) as the model holds them, the floor arithmetic, and the engine in a process of its own."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import quantized
from benchmarks.quantized_floor import BASELINE, EngineProcess, burst, decode_weight_bytes, engine_config, floor_lines
from benchmarks.random_model import ensure_random_llama
from lora_runtime import Engine, EngineConfig
from lora_runtime.memory_budget import Q8_0_BYTES_PER_WEIGHT, safetensors_numels

# Every width a multiple of 32 (the widest packed block), so the packed weights hold no padding.
TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 49152}


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_random_llama(tmp_path_factory.mktemp("quantized-floor") / "model", **TINY)


def test_the_benchmark_starts_as_a_module() -> None:
    completed = subprocess.run([sys.executable, "-m", "benchmarks.quantized", "--help"], capture_output=True,
                               text=True, timeout=120)
    assert completed.returncode == 0, completed.stderr[-2000:]
    assert "--random-llama-1b" in completed.stdout and "--layers" in completed.stdout


@pytest.mark.parametrize("argv", [["--layers", "2"], ["--random-llama-1b", "--new-tokens", "1"]])
def test_options_it_cannot_measure_are_refused(argv: list[str]) -> None:
    with pytest.raises(SystemExit):
        quantized.parse_args(argv)


@pytest.mark.parametrize("quantization", [None, "q8_0"])
def test_a_decode_step_reads_the_projections_and_the_head_as_held(tiny_model: Path, quantization: str | None) -> None:
    """The tied head is the embedding: counted once. In bf16 two bytes a weight; quantized to Q8_0
    (projections and head) 34 bytes a block of 32."""
    numels = safetensors_numels(tiny_model / "model.safetensors")
    read = {name: numel for name, numel in numels.items() if name.endswith("_proj.weight") or name == "model.embed_tokens.weight"}
    per_weight = 2 if quantization is None else Q8_0_BYTES_PER_WEIGHT
    engine = Engine.from_config(EngineConfig(model=str(tiny_model), dtype="bfloat16", quantization=quantization))
    assert decode_weight_bytes(engine.model) == sum(read.values()) * per_weight


def test_the_floor_is_the_bytes_over_the_bandwidth_and_its_ratio_the_bytes_ratio() -> None:
    """bf16 measured at its floor, a file of a quarter of its bytes at twice its floor: that one is
    2x bf16, where the bytes allow 4x."""
    weight_bytes = {BASELINE: 800_000_000, "q4_k_m": 200_000_000}
    read_bytes_per_s = 10e9
    seconds = {BASELINE: 0.08, "q4_k_m": 0.04}
    lines = floor_lines(seconds, weight_bytes, read_bytes_per_s)
    assert lines[BASELINE]["floor_s_per_token"] == pytest.approx(0.08)
    assert lines[BASELINE]["over_floor"] == pytest.approx(1.0)
    assert lines["q4_k_m"]["floor_s_per_token"] == pytest.approx(0.02)
    assert lines["q4_k_m"]["over_floor"] == pytest.approx(2.0)
    assert lines["q4_k_m"]["vs_bf16"] == pytest.approx(2.0)
    assert lines["q4_k_m"]["floor_vs_bf16"] == pytest.approx(4.0)


def test_the_engine_in_its_own_process_runs_bursts_and_reports_its_peak(tiny_model: Path) -> None:
    engine = EngineProcess("tiny", engine_config(tiny_model, max_requests=2, new_tokens=8))
    try:
        in_process = Engine.from_config(EngineConfig(model=str(tiny_model), dtype="bfloat16"))
        assert engine.held["decode_weight_bytes"] == decode_weight_bytes(in_process.model)
        assert engine.held["kv_cache_bytes"] > 0 and engine.held["adapter_pool_bytes"] > 0
        figures = burst(engine, [[1, 2, 3], [4, 5, 6, 7]], new_tokens=8)
        assert figures["decode_tokens_per_cpu_s"] > 0 and figures["decode_s_per_step"] > 0
    finally:
        peak = engine.close()
    assert peak > (tiny_model / "model.safetensors").stat().st_size
