"""merged_adapters past its bounds (docs/api.md section 3) is a 422 naming the field over real HTTP,
refused before any adapter is loaded."""
from __future__ import annotations

import httpx
import pytest

from lora_runtime.adapters.merge_request import MAX_MERGE_WEIGHT, MAX_MERGED_ADAPTERS

pytestmark = pytest.mark.xdist_group("test_merge_bounds")


@pytest.mark.parametrize(("merged", "field"), [
    ({"ids": [f"org/a{idx}" for idx in range(MAX_MERGED_ADAPTERS + 1)]}, "merged_adapters.ids"),
    ({"ids": ["org/a", "org/b"], "weights": [1.0, 1e30]}, "merged_adapters.weights"),
    ({"ids": ["org/a"], "weights": [-1e10]}, "merged_adapters.weights"),
    ({"ids": ["org/a"], "weights": [MAX_MERGE_WEIGHT * 2]}, "merged_adapters.weights"),
])
def test_merges_past_the_bounds_are_422_naming_the_field(live, merged: dict, field: str) -> None:
    body = {"inputs": "Hello", "parameters": {"max_new_tokens": 2, "merged_adapters": merged}}
    response = httpx.post(live.prefix() + "/generate", json=body, headers=live.headers(), timeout=60)
    assert response.status_code == 422, response.text
    body = response.json()
    assert set(body) == {"error", "error_type"} and body["error_type"] == "validation"
    assert body["error"].startswith(f"{field}: ")


def test_the_bound_counts_entries_and_says_so(live) -> None:
    """A repeated id is merged once per entry (PEFT's way, not folded into one summed weight: see
    tests/adapters/test_merge.py), so the bound counts entries, and the refusal says entries."""
    merged = {"ids": ["repo/1"] * 300}
    body = {"inputs": "Hello", "parameters": {"max_new_tokens": 2, "merged_adapters": merged}}
    response = httpx.post(live.prefix() + "/generate", json=body, headers=live.headers(), timeout=60)
    assert response.status_code == 422, response.text
    message = response.json()["error"]
    assert message.startswith(f"merged_adapters.ids: at most {MAX_MERGED_ADAPTERS} entries ")
    assert message.endswith("got 300") and "adapters can be merged" not in message
