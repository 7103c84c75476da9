"""Shared fixtures: the embedded model's tokenizer and HF model (converted once into the cache)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from lora_runtime.embedded import ensure_embedded_model
from lora_runtime.sampling import TokenizerInfo


@pytest.fixture(scope="session")
def model_dir() -> Path:
    return ensure_embedded_model()


@pytest.fixture(scope="session")
def tokenizer(model_dir: Path):
    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="session")
def hf_model(model_dir: Path):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def tokenizer_info(tokenizer, hf_model) -> TokenizerInfo:
    return TokenizerInfo(tokenizer, hf_model.config.vocab_size, [tokenizer.eos_token_id])
