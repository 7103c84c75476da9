"""The registry over HTTP: `server.client` uploads (sync and async) become pbase versions that
generate as PEFT computes them, checkpoints address `repo/N@C`, bad uploads create nothing,
concurrent uploads get consecutive versions, and the repo and version routes of docs/api.md section 1."""
from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import httpx
import pytest

from server.client import AsyncClient, Client, ValidationError
from tests.wiring.conftest import GROUP

pytestmark = GROUP


def _client(wired, tenant: str = "demo", cls=Client):
    live = wired.live
    return cls(live.base_url, live.tokens[tenant], tenant, live.model_name)


def _token_ids(response) -> list[int]:
    assert response.status_code == 200, response.text
    return [token["id"] for token in response.json()["details"]["tokens"]]


def test_uploaded_version_generates_in_its_tenant_only(wired, peft_oracle) -> None:
    version = _client(wired).upload(wired.adapters["a"], "news")
    assert (version.repo, version.tag, version.adapter_id) == ("news", 1, "news/1")
    response = wired.generate({"adapter_id": "news/1"})
    assert _token_ids(response) == peft_oracle["a"]
    assert response.headers["x-adapter-source"] == "pbase"
    other = wired.generate({"adapter_id": "news/1"}, tenant="other")
    assert (other.status_code, other.json()["error_type"]) == (404, "adapter_not_found")


def test_checkpoints_are_addressed_with_at(wired, peft_oracle, tmp_path: Path) -> None:
    run = tmp_path / "run"
    shutil.copytree(wired.adapters["b"], run)
    shutil.copytree(wired.adapters["b"], run / "checkpoint-10")
    shutil.copytree(wired.adapters["a"], run / "checkpoint-20")
    (run / "checkpoint-20" / "optimizer.pt").write_bytes(b"not an adapter file: never sent")
    (run / "trainer_state.json").write_text("{}")
    version = _client(wired).upload(run, "trained")
    assert version.checkpoints == (10, 20)
    assert _token_ids(wired.generate({"adapter_id": f"trained/{version.tag}@20"})) == peft_oracle["a"]
    assert _token_ids(wired.generate({"adapter_id": f"trained/{version.tag}@10"})) != peft_oracle["a"]
    missing = wired.generate({"adapter_id": f"trained/{version.tag}@30"})
    assert (missing.status_code, missing.json()["error_type"]) == (404, "adapter_not_found")


def test_bad_uploads_create_nothing(wired, tmp_path: Path) -> None:
    client = _client(wired)
    with pytest.raises(ValidationError) as incompatible:
        client.upload(wired.adapters["tiny"], "bad-shapes")
    assert incompatible.value.error_type == "adapter_incompatible"
    broken = tmp_path / "broken"
    shutil.copytree(wired.adapters["a"], broken)
    (broken / "adapter_model.safetensors").write_bytes(b"garbage")
    with pytest.raises(ValidationError) as invalid:
        client.upload(broken, "bad-files")
    assert invalid.value.error_type == "adapter_invalid"
    for repo in ("bad-shapes", "bad-files"):
        response = httpx.get(f"{wired.live.base_url}/v2/repos/{repo}", headers=wired.live.headers())
        assert response.status_code == 404


def test_concurrent_uploads_get_consecutive_versions(wired) -> None:
    client = _client(wired, cls=AsyncClient)

    async def upload_all() -> list[int]:
        versions = await asyncio.gather(*(client.upload(wired.adapters["a"], "busy") for _ in range(4)))
        return sorted(version.tag for version in versions)

    assert asyncio.run(upload_all()) == [1, 2, 3, 4]


def test_signed_upload_urls_are_the_only_authorization(wired) -> None:
    live = wired.live
    started = httpx.post(f"{live.base_url}/v2/adapters/upload", json={"repo": "signed"},
                         headers=live.headers()).json()
    assert set(started["presignedUrls"]) == {"adapter_config.json", "adapter_model.bin",
                                             "adapter_model.safetensors"}
    url = started["presignedUrls"]["adapter_config.json"]
    assert httpx.put(url, content=b"{}").status_code == 200  # no Authorization header
    tampered = url.replace("signature=", "signature=0")
    unsigned = url.split("?")[0]
    for bad_url in (tampered, unsigned, url.replace("adapter_config.json", "adapter_model.bin", 1)):
        response = httpx.put(bad_url, content=b"{}")
        assert (response.status_code, response.json()["error_type"]) == (403, "forbidden")
    finish = {"uploadToken": started["uploadToken"]}
    response = httpx.put(f"{live.base_url}/v2/adapters/upload/", json=finish, headers=live.headers("other"))
    assert response.status_code == 404  # another tenant cannot finish it


def test_repo_and_version_routes(wired) -> None:
    live, headers = wired.live, wired.live.headers()
    body = {"name": "catalog", "description": "routes", "existsOk": False}
    created = httpx.post(f"{live.base_url}/v2/repos", json=body, headers=headers)
    assert created.status_code == 200 and created.json()["name"] == "catalog"
    assert httpx.post(f"{live.base_url}/v2/repos", json=body, headers=headers).status_code == 409
    again = httpx.post(f"{live.base_url}/v2/repos", json={**body, "existsOk": True}, headers=headers)
    assert again.json()["uuid"] == created.json()["uuid"]
    _client(wired).upload(wired.adapters["a"], "catalog")
    listed = httpx.get(f"{live.base_url}/v2/repos?limit=100", headers=headers).json()["data"]["repos"]
    assert "catalog" in {repo["name"] for repo in listed}
    version_url = f"{live.base_url}/v2/repos/catalog/version/1"
    assert httpx.get(version_url, headers=headers).json()["adapterPath"] == "catalog/1"
    archived = httpx.put(version_url, json={"archived": True}, headers=headers).json()
    assert archived["archived"] is True
    assert httpx.get(version_url, headers=live.headers("other")).status_code == 404
    assert httpx.delete(version_url, headers=headers).status_code == 200
    assert httpx.get(version_url, headers=headers).status_code == 404
    assert httpx.delete(f"{live.base_url}/v2/repos/catalog", headers=headers).status_code == 200
    assert httpx.get(f"{live.base_url}/v2/repos/catalog", headers=headers).status_code == 404
    assert httpx.get(f"{live.base_url}/v2/repos").status_code == 401


def test_deleted_versions_are_not_served_from_the_cache(wired, peft_oracle) -> None:
    live, client = wired.live, _client(wired)
    client.upload(wired.adapters["a"], "reborn")
    assert _token_ids(wired.generate({"adapter_id": "reborn/1"})) == peft_oracle["a"]  # now cached
    assert httpx.delete(f"{live.base_url}/v2/repos/reborn/version/1", headers=live.headers()).status_code == 200
    gone = wired.generate({"adapter_id": "reborn/1"})
    assert (gone.status_code, gone.json()["error_type"]) == (404, "adapter_not_found")
    assert httpx.delete(f"{live.base_url}/v2/repos/reborn", headers=live.headers()).status_code == 200
    client.upload(wired.adapters["b"], "reborn")  # a new repo of the same name: its version 1 again
    adapter_b = _token_ids(wired.generate({"adapter_id": "org/adapter-b"}))
    assert _token_ids(wired.generate({"adapter_id": "reborn/1"})) == adapter_b != peft_oracle["a"]


def test_openapi_documents_the_registry_routes(wired) -> None:
    paths = httpx.get(f"{wired.live.base_url}/openapi.json").json()["paths"]
    assert {"/v2/repos", "/v2/repos/{name}", "/v2/repos/{repo}/version/{tag}", "/v2/adapters/upload",
            "/v2/adapters/upload/"} <= set(paths)
    signed = next(operations for path, operations in paths.items() if path.startswith("/v2/adapters/upload/files"))
    assert "security" not in signed["put"]
    assert paths["/v2/adapters/upload/"]["put"]["security"] == [{"bearer": []}]
