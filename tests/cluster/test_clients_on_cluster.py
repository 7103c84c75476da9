"""The single server's client tests (tests/server/test_clients.py: lorax-client, text-generation and
ours, answers and typed errors) run unchanged against the cluster's ingress, `live` being the
cluster (tests/cluster/conftest.py). Left out: the overload test, which fills the in-process engine's admission directly (the
cluster's 429 is tests/cluster/test_cluster.py's)."""
from __future__ import annotations

import pytest

from tests.cluster.conftest import GROUP
from tests.server.test_clients import (  # noqa: F401  (collected here: tests and their fixture)
    reference,
    test_lorax_async_client,
    test_lorax_client_gets_alternative_tokens,
    test_official_clients_generate_and_stream,
    test_official_clients_raise_their_typed_errors,
    test_our_client_raises_typed_errors,
    test_our_clients_sync_and_async,
    test_text_generation_client_gets_tgis_grammar_top_tokens_and_frequency_penalty,
)

pytestmark = [GROUP, pytest.mark.slow]
