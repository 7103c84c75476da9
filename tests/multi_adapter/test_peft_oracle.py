"""Our engine with adapters against PEFT (`PeftModel` on the HF model), fp32 atol 1e-4: logits of
prefill and decode steps in one mixed batch, greedy tokens alone and together, and failures that stay
with their own request."""
from __future__ import annotations

import json

import pytest
import torch

from lora_runtime import SamplingParams
from lora_runtime.adapters.page_tensors import bytes_per_page
from lora_runtime.config import AdapterConfig
from tests.adapters.peft_factory import tiny_shape
from tests.multi_adapter.conftest import ADAPTER_CONFIGS, make_engine

ATOL = 1e-4
PROMPTS = [[5, 17, 33, 9, 60, 2 + i, 77][: 4 + i % 4] for i in range(8)]
# Every adapter, two requests on the same adapter, and base-model requests, mixed in one batch.
ASSIGNMENT = ["q_v_r8", None, "all_linear_r4", "rslora_r16", "q_v_r8", "patterns", None, "layer1_only"]


def _reference_model(name, hf_base, peft_models):
    return hf_base if name is None else peft_models[name]


def test_mixed_batch_logits_match_peft(tiny_dir, hf_base, adapter_dirs, peft_models) -> None:
    engine = make_engine(tiny_dir)
    params = SamplingParams(max_new_tokens=4, decoder_input_details=True, details=True)
    adapters = [None if name is None else str(adapter_dirs[name]) for name in ASSIGNMENT]
    outputs = engine.generate(PROMPTS, params, adapters=adapters)
    with torch.no_grad():
        for output, name in zip(outputs, ASSIGNMENT):
            model = _reference_model(name, hf_base, peft_models)
            ids = output.prompt_token_ids + output.token_ids
            logprobs = torch.log_softmax(model(torch.tensor([ids])).logits[0], dim=-1)
            expected_tokens = logprobs[len(output.prompt_token_ids) - 1 : -1].argmax(-1).tolist()
            assert output.token_ids == expected_tokens, f"greedy tokens differ for adapter {name}"
            generated = [t.logprob for t in output.tokens]
            expected = [logprobs[len(output.prompt_token_ids) - 1 + i, t].item() for i, t in enumerate(output.token_ids)]
            assert generated == pytest.approx(expected, abs=ATOL)
            prompt = [p.logprob for p in output.prefill][1:]
            expected_prompt = [logprobs[i, t].item() for i, t in enumerate(output.prompt_token_ids[1:])]
            assert prompt == pytest.approx(expected_prompt, abs=ATOL)


def test_batch_invariance_alone_equals_together(tiny_dir, adapter_dirs) -> None:
    engine = make_engine(tiny_dir)
    params = SamplingParams(max_new_tokens=6, ignore_eos_token=True)
    adapters = [None if name is None else str(adapter_dirs[name]) for name in ASSIGNMENT]
    together = [o.token_ids for o in engine.generate(PROMPTS, params, adapters=adapters)]
    alone = [engine.generate([p], params, adapters=[a])[0].token_ids for p, a in zip(PROMPTS, adapters)]
    assert together == alone
    assert len({tuple(t) for t in together}) > 2, "adapters must change the outputs for this test to mean anything"


def test_more_adapters_than_the_pool_holds_at_once_still_serves_everyone(tiny_dir, adapter_dirs) -> None:
    """Six adapters of rank <= 16 through a pool of two pages per module (two adapters at once):
    requests wait for pages, idle adapters are evicted and placed again, and every request gets
    what it gets alone."""
    one_page = bytes_per_page(tiny_shape(), torch.float32)
    engine = make_engine(tiny_dir, AdapterConfig(max_rank=16, device_pool_bytes=2 * one_page))
    assert engine.adapters.pages.num_pages == 2
    params = SamplingParams(max_new_tokens=3, ignore_eos_token=True)
    names = list(ADAPTER_CONFIGS)
    adapters = [str(adapter_dirs[name]) for name in names]
    together = [o.token_ids for o in engine.generate(PROMPTS[: len(names)], params, adapters=adapters)]
    alone = [make_engine(tiny_dir).generate([p], params, adapters=[a])[0].token_ids for p, a in zip(PROMPTS, adapters)]
    assert together == alone
    assert engine.adapters.pages.num_resident < len(names) and engine.adapters.pages.num_pinned == 0


def _corrupt(directory, tmp_path, name: str, mutate) -> str:
    target = tmp_path / name
    target.mkdir()
    for path in directory.iterdir():
        (target / path.name).write_bytes(path.read_bytes())
    mutate(target)
    return str(target)


def test_bad_adapters_fail_only_their_own_request(tiny_dir, adapter_dirs, tmp_path) -> None:
    good = adapter_dirs["q_v_r8"]
    bad = {
        "corrupt_weights": _corrupt(good, tmp_path, "corrupt", lambda d: (d / "adapter_model.safetensors").write_bytes(b"not safetensors")),
        "missing_config": _corrupt(good, tmp_path, "noconfig", lambda d: (d / "adapter_config.json").unlink()),
        "dora": _corrupt(good, tmp_path, "dora", lambda d: _edit_config(d, use_dora=True)),
        "rank_too_large": str(adapter_dirs["rslora_r16"]),
    }
    engine = make_engine(tiny_dir, AdapterConfig(max_rank=8))
    params = SamplingParams(max_new_tokens=3, ignore_eos_token=True)
    adapters = [str(good), *bad.values(), None]
    outputs = engine.generate(PROMPTS[: len(adapters)], params, adapters=adapters)
    assert outputs[0].error is None and len(outputs[0].token_ids) == 3
    assert outputs[-1].error is None and len(outputs[-1].token_ids) == 3
    errors = {name: out.error for name, out in zip(bad, outputs[1:-1])}
    assert errors["corrupt_weights"].error_type == "adapter_invalid"
    assert errors["missing_config"].error_type in ("adapter_invalid", "adapter_not_found")
    assert errors["dora"].error_type == "adapter_invalid" and "use_dora" in str(errors["dora"])
    assert errors["rank_too_large"].error_type == "adapter_incompatible"
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks


def _edit_config(directory, **changes) -> None:
    path = directory / "adapter_config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))
