"""A plain decode loop for tests: the HF model computes logits, our Sampler picks the tokens."""
from __future__ import annotations

import torch

from lora_runtime.sampling import Sampler, SamplingState


@torch.inference_mode()
def generate(hf_model, prompt_ids: list[int], state: SamplingState, eos_token_ids, max_new_tokens: int) -> list[int]:
    """Sample up to `max_new_tokens` ids for one request, stopping after EOS."""
    sampler = Sampler()
    output = hf_model(torch.tensor([prompt_ids]), use_cache=True)
    for _ in range(max_new_tokens):
        token_id = sampler.sample(output.logits[:, -1], [state]).token_ids[0]
        state.accept(token_id)
        if token_id in eos_token_ids:
            break
        output = hf_model(torch.tensor([[token_id]]), past_key_values=output.past_key_values, use_cache=True)
    return state.token_ids
