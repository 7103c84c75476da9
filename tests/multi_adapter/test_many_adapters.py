"""Many distinct adapters in one step, against PEFT: N adapters of different ranks (1 to 64) and
target sets, some with rank_pattern, alpha_pattern, layers_to_transform or rslora, each served to its
own request, all N in the first step of one batch with base-model requests; every request's greedy
tokens and their logprobs equal PEFT's for that adapter (fp32, atol 1e-4). The oracle is one
PeftModel holding all N adapters, run per request with `adapter_names`."""
from __future__ import annotations

import copy
import random

import pytest
import torch
from peft import LoraConfig, get_peft_model

from lora_runtime import SamplingParams
from lora_runtime.config import SchedulerConfig
from tests.adapters.peft_factory import randomize_lora, save_adapters
from tests.multi_adapter.conftest import make_engine

ATOL = 1e-4
MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
NEW_TOKENS = 3


def adapter_config(rng: random.Random) -> LoraConfig:
    """A random adapter: rank, targets, and sometimes per-layer or per-module variations."""
    rank = rng.choice([1, 2, 4, 8, 15, 16, 17, 33, 64])
    targets = rng.sample(MODULES, rng.randint(1, len(MODULES)))
    extra = {}
    variation = rng.randrange(5)
    if variation == 0:
        extra["rank_pattern"] = {targets[0]: rng.choice([2, 8, 24])}
    elif variation == 1:
        extra["alpha_pattern"] = {targets[-1]: 3}
    elif variation == 2:
        extra["layers_to_transform"] = [rng.randrange(2)]
    elif variation == 3:
        extra["use_rslora"] = True
    return LoraConfig(r=rank, lora_alpha=rng.choice([4, 8, 16, 32]), target_modules=targets, **extra)


@pytest.fixture(scope="module")
def many_adapters(hf_base, tmp_path_factory):
    """300 random adapters on the tiny model: one PeftModel holding them all, and their directories."""
    rng = random.Random(300)
    names = [f"a{i:03d}" for i in range(300)]
    model = get_peft_model(copy.deepcopy(hf_base), adapter_config(rng), adapter_name=names[0])
    for name in names[1:]:
        model.add_adapter(name, adapter_config(rng))
    randomize_lora(model, seed=300)
    root = tmp_path_factory.mktemp("many-adapters")
    directories = [str(d) for d in save_adapters(model, root, names)]
    return model.eval(), names, directories


@pytest.mark.parametrize(("num_adapters", "backend"), [
    (1, None), (7, None), (64, None), (300, None), (7, "torch"), (7, "triton"),
])
def test_distinct_adapters_in_one_step_match_peft(tiny_dir, many_adapters, num_adapters, backend) -> None:
    peft, names, directories = many_adapters
    rng = random.Random(num_adapters)
    # Every adapter once, the first few twice more, and base-model requests between them.
    assignment = list(range(num_adapters)) + list(range(min(3, num_adapters))) + [None] * 3
    rng.shuffle(assignment)
    prompts = [[rng.randrange(5, 120) for _ in range(rng.randint(2, 7))] for _ in assignment]
    engine = make_engine(tiny_dir, scheduler=SchedulerConfig(max_num_seqs=512, max_num_batched_tokens=8192),
                         backend=backend)
    params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos_token=True, details=True)
    leases = {i: engine.adapters.acquire(engine.adapters.parse(directories[i])) for i in set(assignment) - {None}}
    for lease in leases.values():
        lease.load.result(timeout=120)  # loaded before the first step, so it holds every request
    ids = [engine.add_request(prompt, params, None if i is None else leases[i].share()) for prompt, i in zip(prompts, assignment)]
    for lease in leases.values():
        lease.release()
    first_step = engine.step()
    assert {output.request_id for output in first_step} == set(ids), "every request runs in the first step"
    final = {}
    while engine.has_unfinished_requests():
        final.update((output.request_id, output) for output in engine.step() if output.finished)
    with torch.no_grad():
        for request_id, prompt, i in zip(ids, prompts, assignment):
            output = final[request_id]
            sequence = torch.tensor([prompt + output.token_ids])
            if i is None:
                with peft.disable_adapter():
                    logits = peft(sequence).logits[0]
            else:
                logits = peft(sequence, adapter_names=[names[i]]).logits[0]
            logprobs = torch.log_softmax(logits, dim=-1)[len(prompt) - 1 : -1]
            assert output.token_ids == logprobs.argmax(-1).tolist(), f"greedy tokens differ for {names[i] if i is not None else 'base'}"
            expected = logprobs[torch.arange(NEW_TOKENS), output.token_ids].tolist()
            assert [t.logprob for t in output.tokens] == pytest.approx(expected, abs=ATOL)
    assert engine.adapters.pages.num_pinned == 0
