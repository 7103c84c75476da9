"""SamplingParams' checks of the penalties, logit_bias, top_logprobs and regex: each bad value is a
ValidationError naming its field."""
from __future__ import annotations

import pytest

from lora_runtime.core import SamplingParams
from lora_runtime.errors import ValidationError


@pytest.mark.parametrize(("fields", "field"), [
    ({"frequency_penalty": 2.5}, "frequency_penalty"),
    ({"frequency_penalty": float("nan")}, "frequency_penalty"),
    ({"frequency_penalty": "1"}, "frequency_penalty"),
    ({"presence_penalty": -2.01}, "presence_penalty"),
    ({"presence_penalty": float("inf")}, "presence_penalty"),
    ({"penalty_counts": "prompt"}, "penalty_counts"),
    ({"logit_bias": [(1, 100.5)]}, "logit_bias"),
    ({"logit_bias": [(1, float("nan"))]}, "logit_bias"),
    ({"logit_bias": [(-1, 1.0)]}, "logit_bias"),
    ({"logit_bias": [(1.5, 1.0)]}, "logit_bias"),
    ({"logit_bias": [(1, 1.0, 2.0)]}, "logit_bias"),
    ({"logit_bias": [7]}, "logit_bias"),
    ({"logit_bias": [(3, 1.0), (3, 2.0)]}, "logit_bias"),
    ({"logit_bias": [(i, 1.0) for i in range(301)]}, "logit_bias"),
    ({"top_logprobs": 21}, "top_logprobs"),
    ({"top_logprobs": -1}, "top_logprobs"),
    ({"top_logprobs": True}, "top_logprobs"),
    ({"regex": r"\d+", "schema": '{"type": "string"}'}, "regex"),
    ({"regex": 5}, "regex"),
])
def test_bad_values_are_refused_naming_the_field(fields: dict, field: str) -> None:
    with pytest.raises(ValidationError) as error:
        SamplingParams(**fields)
    assert error.value.field == field


def test_edges_are_accepted_and_lists_become_tuples() -> None:
    params = SamplingParams(frequency_penalty=-2.0, presence_penalty=2, penalty_counts="sequence_fraction",
                            logit_bias=[[5, -100], (6, 100.0)], top_logprobs=20, regex="")
    assert params.logit_bias == ((5, -100), (6, 100.0))
    assert SamplingParams(logit_bias=[(i, 0.5) for i in range(300)]).logit_bias[299] == (299, 0.5)
    assert SamplingParams(top_logprobs=0).top_logprobs == 0
    assert hash(params)  # frozen and hashable, as the tuples make it


def test_penalties_and_bias_do_not_turn_sampling_on() -> None:
    params = SamplingParams(frequency_penalty=1.0, presence_penalty=1.0, logit_bias=[(1, 5.0)], regex="a+")
    assert not params.is_sampling
