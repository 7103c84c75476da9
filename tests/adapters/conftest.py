import pytest
from transformers import LlamaForCausalLM

from tests.adapters.peft_factory import tiny_llama


@pytest.fixture(scope="session")
def tiny_base() -> LlamaForCausalLM:
    return tiny_llama()
