import os

# Tests never reach a hub; set before transformers / huggingface_hub are imported.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
from transformers import LlamaForCausalLM  # noqa: E402

from tests.adapters.peft_factory import tiny_llama  # noqa: E402


@pytest.fixture(scope="session")
def tiny_base() -> LlamaForCausalLM:
    return tiny_llama()
