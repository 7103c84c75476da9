"""The committed demo adapters through our engine: one batch mixing the base model and the three
adapters shows each adapter's behaviour on held-out questions, and none on the base model. The
engine is the default one, as `make serve` registers the adapters on it: the embedded model's GGUF
served as it is (Q4_1 blocks, bf16 activations on AVX-512), while the adapters were trained on its
full-precision Hugging Face directory (scripts/train_demo_adapters.py)."""
from __future__ import annotations

import pytest

from lora_runtime import Engine, EngineConfig, SamplingParams
from tests.adapters.demo_behaviour import BEHAVIOUR, DEMO_DIR, HELD_OUT_QUESTIONS

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def generations() -> dict[str | None, list[str]]:
    engine = Engine.from_config(EngineConfig())
    rows = [(name, question) for name in [None, *BEHAVIOUR] for question in HELD_OUT_QUESTIONS]
    params = SamplingParams(max_new_tokens=64, apply_chat_template=True)
    adapters = [None if name is None else str(DEMO_DIR / name) for name, _ in rows]
    outputs = engine.generate([question for _, question in rows], params, adapters=adapters)
    by_name: dict[str | None, list[str]] = {}
    for (name, _), output in zip(rows, outputs):
        assert output.error is None, output.error
        by_name.setdefault(name, []).append(output.text.strip())
    return by_name


@pytest.mark.parametrize("name", list(BEHAVIOUR))
def test_each_adapter_shows_its_behaviour_in_a_mixed_batch(name: str, generations) -> None:
    shows = BEHAVIOUR[name]
    assert all(shows(text) for text in generations[name]), generations[name]
    assert not any(shows(text) for text in generations[None]), generations[None]
