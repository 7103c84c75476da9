from __future__ import annotations

from pathlib import Path

import pytest

from lora_runtime.embedded import ensure_embedded_model


@pytest.fixture(scope="session")
def embedded_model_dir() -> Path:
    return ensure_embedded_model()


@pytest.fixture(scope="session")
def hf_embedded_model(embedded_model_dir):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(embedded_model_dir, dtype=torch.float32).eval()
