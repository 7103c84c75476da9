"""merged_adapters through the engine against PEFT's `add_weighted_adapter` on the same files:
the greedy tokens and their logprobs of the merged model agree within 1e-4."""
from __future__ import annotations

import copy

import pytest
import torch
from peft import PeftModel

from lora_runtime import MergedAdapters, SamplingParams
from tests.multi_adapter.conftest import make_engine

PROMPT = [5, 17, 33, 9, 60]
MERGES = [
    ("linear", dict(weights=[0.7, 0.5])),
    ("ties", dict(weights=[1.0, 0.6], density=0.5, majority_sign_method="total")),
    ("ties", dict(weights=[0.8, -0.4], density=0.7, majority_sign_method="frequency")),
]


@pytest.mark.parametrize("strategy,options", MERGES)
def test_merged_adapter_matches_peft(tiny_dir, hf_base, adapter_dirs, strategy: str, options: dict) -> None:
    names = ["q_v_r8", "q_o_up_r8"]
    peft = PeftModel.from_pretrained(copy.deepcopy(hf_base), str(adapter_dirs[names[0]]), adapter_name=names[0])
    peft.load_adapter(str(adapter_dirs[names[1]]), adapter_name=names[1])
    peft.add_weighted_adapter(
        names, options["weights"], "merged", combination_type=strategy,
        density=options.get("density"), majority_sign_method=options.get("majority_sign_method", "total"),
    )
    peft.set_adapter("merged")
    merged = MergedAdapters(ids=[str(adapter_dirs[n]) for n in names], merge_strategy=strategy, **options)
    output = make_engine(tiny_dir).generate([PROMPT], SamplingParams(max_new_tokens=5, ignore_eos_token=True), adapters=[merged])[0]
    assert output.error is None
    with torch.no_grad():
        logprobs = torch.log_softmax(peft(torch.tensor([PROMPT + output.token_ids])).logits[0], dim=-1)
    start = len(PROMPT) - 1
    assert output.token_ids == logprobs[start:-1].argmax(-1).tolist()
    expected = [logprobs[start + i, t].item() for i, t in enumerate(output.token_ids)]
    assert [t.logprob for t in output.tokens] == pytest.approx(expected, abs=1e-4)
