"""A step's rows sampled as one batch, each row's failure its own: a request whose logits processing
raises (its grammar, say) or whose scores are not finite gets its error, and the others their tokens."""
from __future__ import annotations

import torch

from lora_runtime.errors import NonFiniteLogitsError
from lora_runtime.sampling.sampler import SampleResult, Sampler, SamplingState, TopPairs

# A row's (token id, logprob, top tokens), or the error that ended its request.
RowSample = tuple[int, float, TopPairs] | Exception


def sample_rows(sampler: Sampler, logits: torch.Tensor, states: list[SamplingState]) -> list[RowSample]:
    """Each row of `logits` [num_rows, vocab] sampled as one batch; if the batch raises, each row
    alone. (Rows redrawn alone after a failure inside the batch's draws may not repeat their seeded
    draws; the batch raises before drawing in every failure we know of: the processors run first.)"""
    try:
        return _samples_of(sampler.sample(logits, states))
    except Exception:
        samples: list[RowSample] = []
        for row, state in enumerate(states):
            try:
                samples.extend(_samples_of(sampler.sample(logits[row : row + 1], [state])))
            except Exception as error:
                samples.append(error)
        return samples


def _samples_of(result: SampleResult) -> list[RowSample]:
    """Each row's (token, logprob, top tokens), or the error of a row whose scores were not finite."""
    return [(token_id, logprob, top) if finite else NonFiniteLogitsError()
            for token_id, logprob, top, finite in zip(result.token_ids, result.logprobs, result.top, result.finite)]
