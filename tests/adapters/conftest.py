from collections.abc import Iterator

import pytest
from transformers import LlamaForCausalLM

from tests.adapters.peft_factory import tiny_llama
from benchmarks.loopback_hub import HubServer


@pytest.fixture(scope="session")
def tiny_base() -> LlamaForCausalLM:
    return tiny_llama()


@pytest.fixture(scope="module")
def hub() -> Iterator[HubServer]:
    """A Hugging Face hub on loopback, driven by the real `huggingface_hub`."""
    server = HubServer().start()
    yield server
    server.stop()
