"""A plain decode loop for tests: the HF model computes logits, our Sampler picks the tokens."""
from __future__ import annotations

from collections.abc import Collection, Sequence

import torch

from lora_runtime.sampling import Sampler, SamplingState


@torch.inference_mode()
def generate(
    hf_model, prompts: Sequence[list[int]], states: Sequence[SamplingState], eos_token_ids: Collection[int],
    max_new_tokens: int,
) -> list[list[int]]:
    """Decode all prompts together (left-padded, one HF forward per step) until each has produced EOS
    or `max_new_tokens`; row i is sampled with `states[i]`. Returns each row's generated ids."""
    pad_id = next(iter(eos_token_ids))
    width = max(len(p) for p in prompts)
    input_ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])  # [num_rows, width]
    attention = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    positions = (attention.cumsum(-1) - 1).clamp(min=0)
    output = hf_model(input_ids, attention_mask=attention, position_ids=positions, use_cache=True)
    active = list(range(len(prompts)))
    for _ in range(max_new_tokens):
        chosen = Sampler().sample(output.logits[active, -1], [states[i] for i in active]).token_ids
        next_ids = [pad_id] * len(prompts)
        for row, token_id in zip(active, chosen):
            states[row].accept(token_id)
            next_ids[row] = token_id
        active = [row for row in active if states[row].token_ids[-1] not in eos_token_ids]
        if not active:
            break
        attention = torch.cat([attention, torch.ones(len(prompts), 1, dtype=attention.dtype)], dim=1)
        positions = positions[:, -1:] + 1
        output = hf_model(torch.tensor(next_ids)[:, None], attention_mask=attention, position_ids=positions,
                          past_key_values=output.past_key_values, use_cache=True)
    return [state.token_ids for state in states]
