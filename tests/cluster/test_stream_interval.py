"""Replicas send several outputs a message (`--stream-interval`): the client still gets one event a
token, in order, the same tokens as the whole request's, however the count divides by the interval."""
from __future__ import annotations

import json

import httpx
import pytest

from server.cluster.app import application, cluster_parser
from tests.cluster.conftest import GROUP, STREAM_INTERVAL, Cluster

pytestmark = GROUP


def test_a_stream_of_grouped_outputs_has_one_event_a_token_in_order(cluster: Cluster) -> None:
    num_tokens = 2 * STREAM_INTERVAL + 2  # the first alone, one whole group, and a short last one
    body = {"inputs": "Once upon a time", "parameters": {"max_new_tokens": num_tokens, "ignore_eos_token": True,
                                                         "details": True}}
    whole = httpx.post(cluster.prefix() + "/generate", json=body, headers=cluster.headers(), timeout=120)
    whole.raise_for_status()
    with httpx.stream("POST", cluster.prefix() + "/generate_stream", json=body, headers=cluster.headers(),
                      timeout=120) as response:
        events = [json.loads(line.removeprefix("data:")) for line in response.iter_lines() if line.startswith("data:")]
    assert [event["token"]["id"] for event in events] == [token["id"] for token in whole.json()["details"]["tokens"]]
    assert len(events) == num_tokens and [event["generated_text"] is not None for event in events] == (
        [False] * (num_tokens - 1) + [True])
    assert events[-1]["generated_text"] == whole.json()["generated_text"]


def test_a_stream_interval_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="--stream-interval"):
        application(cluster_parser().parse_args(["--stream-interval", "0"]))
