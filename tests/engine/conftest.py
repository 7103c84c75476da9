from __future__ import annotations

from pathlib import Path

import pytest

from lora_runtime.embedded import ensure_embedded_model


@pytest.fixture(scope="session")
def embedded_model_dir() -> Path:
    return ensure_embedded_model()


@pytest.fixture(scope="module")
def engine(embedded_model_dir):
    """The embedded model's Hugging Face directory in float32, one per test module (a module may define
    its own): the directory `hf_embedded_model` loads, so the engine and the oracle read the same weights
    (the default model, its GGUF served as it is, is tested in test_default_model.py)."""
    from lora_runtime import Engine, EngineConfig

    return Engine.from_config(EngineConfig(model=str(embedded_model_dir), dtype="float32"))


@pytest.fixture(scope="session")
def hf_embedded_model(embedded_model_dir):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(embedded_model_dir, dtype=torch.float32).eval()
