"""The real `predibase` SDK against this server (issue 7): `PREDIBASE_GATEWAY` is our URL and the
deployment client's `serving_url_override` too. It creates and reads repos, uploads an adapter with
`pb.adapters.upload` (its own three-step protocol), and generates with it as `adapter_id="repo/1"`,
whose tokens are those HF + PEFT compute with the same adapter."""
from __future__ import annotations

import pytest

from tests.wiring.conftest import GROUP, NUM_NEW_TOKENS, PROMPT

pytestmark = GROUP
predibase = pytest.importorskip("predibase", reason="the predibase SDK is not installed (requirements.txt)")


@pytest.fixture()
def pb(wired, monkeypatch):
    monkeypatch.setenv("PREDIBASE_GATEWAY", wired.live.base_url)
    return predibase.Predibase(api_token=wired.live.tokens["demo"])


def test_sdk_repos_upload_and_generate(pb, wired, peft_oracle) -> None:
    created = pb.repos.create(name="sdk-repo", description="from the SDK", exists_ok=True)
    assert created.name == "sdk-repo" and pb.repos.get("sdk-repo").uuid == created.uuid
    assert "sdk-repo" in {repo.name for repo in pb.repos.list(limit=50)}
    adapter = pb.adapters.upload(str(wired.adapters["a"]), "sdk-repo")
    assert (adapter.repo, adapter.tag, adapter.name) == ("sdk-repo", 1, "sdk-repo/1")
    assert pb.adapters.get("sdk-repo/1").tag == 1
    client = pb.deployments.client(wired.live.model_name, serving_url_override=wired.live.base_url)
    response = client.generate(PROMPT, adapter_id="sdk-repo/1", max_new_tokens=NUM_NEW_TOKENS)
    assert [token.id for token in response.details.tokens] == peft_oracle["a"]
