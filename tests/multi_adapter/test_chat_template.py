"""apply_chat_template with adapters: an adapter shipping a chat template (tokenizer files beside
its weights) has it used; one without falls back to the base model's (rendering itself is checked on
the embedded model in tests/engine/test_generation_params.py)."""
from __future__ import annotations

import json
import shutil

from lora_runtime import SamplingParams
from tests.multi_adapter.conftest import make_engine

ADAPTER_TEMPLATE = "{% for m in messages %}<<{{ m['role'] }}>>{{ m['content'] }}{% endfor %}<<assistant>>"
PARAMS = SamplingParams(max_new_tokens=1, apply_chat_template=True)


def test_an_adapter_shipping_a_template_has_it_chosen(tiny_dir, adapter_dirs, tmp_path) -> None:
    adapter = tmp_path / "templated"
    shutil.copytree(adapter_dirs["q_v_r8"], adapter)
    (adapter / "tokenizer_config.json").write_text(json.dumps({"chat_template": ADAPTER_TEMPLATE}))
    (tmp_path / "named").mkdir()
    named = tmp_path / "named" / "adapter"
    shutil.copytree(adapter_dirs["q_v_r8"], named)
    (named / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": [{"name": "tool_use", "template": "x"}, {"name": "default", "template": ADAPTER_TEMPLATE}]}))
    engine = make_engine(tiny_dir)
    for directory, expected in ((adapter, ADAPTER_TEMPLATE), (named, ADAPTER_TEMPLATE), (adapter_dirs["q_v_r8"], None)):
        lease = engine.adapters.acquire(engine.adapters.parse(str(directory)))
        assert engine._chat_template(PARAMS, lease) == expected
        lease.release()
