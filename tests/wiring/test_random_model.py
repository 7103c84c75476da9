"""`benchmarks.random_model`: a random-weight Llama directory our loader and engine serve (made tiny
here; the benchmark's is Llama-3.2-1B's shape), written once and reused."""
from __future__ import annotations

from pathlib import Path

from benchmarks.random_model import ensure_random_llama
from lora_runtime import Engine, EngineConfig, SamplingParams

TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 50000}


def test_a_random_llama_serves_and_is_reused(tmp_path: Path) -> None:
    directory = ensure_random_llama(tmp_path / "model", **TINY)
    written = (directory / "model.safetensors").stat().st_mtime_ns
    assert ensure_random_llama(tmp_path / "model", **TINY) == directory
    assert (directory / "model.safetensors").stat().st_mtime_ns == written
    engine = Engine.from_config(EngineConfig(model=str(directory), dtype="float32"))
    shape = engine.model.shape
    assert (shape.num_layers, shape.num_kv_heads, shape.vocab_size) == (2, 2, 50000)
    output = engine.generate(["Hello"], SamplingParams(max_new_tokens=3, ignore_eos_token=True))[0]
    assert output.error is None and len(output.token_ids) == 3
