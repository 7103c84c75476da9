"""The single server's OpenAI-route tests (tests/server/test_openai.py, the real `openai` client)
that need nothing but HTTP, run unchanged against the cluster's ingress. Left out: those that read
or fill the in-process engine (metrics, tokenizer, a full server, disconnects, registry internals)
and the private-deployment one (the cluster registers no private deployments)."""
from __future__ import annotations

import pytest

from tests.cluster.conftest import GROUP
from tests.server.test_openai import (  # noqa: F401  (collected here)
    test_chat_equals_the_tgi_route_with_the_chat_template,
    test_chat_logprobs_are_the_tgi_logprobs_with_their_top_alternatives,
    test_completion_logprobs_with_echo_cover_the_prompt,
    test_completions_equal_the_tgi_route,
    test_errors_raise_the_clients_typed_exceptions,
    test_json_schema_output_validates,
    test_models_lists_the_base_model_and_the_tenants_adapters,
    test_seed_makes_sampling_reproducible_and_n_gives_distinct_choices,
    test_stop_sequences_end_the_text_without_being_part_of_it,
    test_streams_equal_the_whole_answers_and_report_usage,
)

pytestmark = [GROUP, pytest.mark.slow]
