from __future__ import annotations

from pathlib import Path

import pytest

from lora_runtime.embedded import ensure_embedded_model


@pytest.fixture(scope="session")
def embedded_model_dir() -> Path:
    return ensure_embedded_model()


@pytest.fixture(scope="module")
def engine(embedded_model_dir):
    """The embedded model in float32, one per test module (a module may define its own)."""
    from lora_runtime import Engine, EngineConfig

    return Engine.from_config(EngineConfig(dtype="float32"))


@pytest.fixture(scope="session")
def hf_embedded_model(embedded_model_dir):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(embedded_model_dir, dtype=torch.float32).eval()
