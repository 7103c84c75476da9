"""Repo and version records on SQLite and PostgreSQL: tenancy, numbering, archiving, deletion."""

from __future__ import annotations

import threading

import pytest

from lora_runtime.errors import ValidationError
from server.registry import repos
from server.registry.errors import RepoExistsError, RepoNotFoundError, VersionNotFoundError
from server.registry.repos import SessionFactory


def _add(sessions: SessionFactory, tenant: str, repo: str, blob_id: str) -> int:
    return repos.add_version(sessions, tenant, repo, "alice", blob_id, "base/model").tag


def test_repos_are_unique_per_tenant(sessions: SessionFactory) -> None:
    first = repos.create_repo(sessions, "t1", "news", "alice", description="summaries")
    assert repos.create_repo(sessions, "t2", "news", "bob").uuid != first.uuid
    with pytest.raises(RepoExistsError):
        repos.create_repo(sessions, "t1", "news", "alice")
    assert repos.create_repo(sessions, "t1", "news", "alice", exists_ok=True).uuid == first.uuid
    assert [r.name for r in repos.list_repos(sessions, "t1")] == ["news"]
    assert repos.get_repo(sessions, "t1", "news").to_api()["description"] == "summaries"
    with pytest.raises(RepoNotFoundError):
        repos.get_repo(sessions, "t3", "news")


@pytest.mark.parametrize("name", ["", "../x", "a/b", "-x", "x" * 97, "a..b"])
def test_repo_names_are_validated(sessions: SessionFactory, name: str) -> None:
    with pytest.raises(ValidationError):
        repos.create_repo(sessions, "t1", name, "alice")


def test_versions_count_up_per_repo_and_numbers_are_never_reused(sessions: SessionFactory) -> None:
    assert [_add(sessions, "t1", "news", f"blob{i}") for i in range(3)] == [1, 2, 3]
    assert _add(sessions, "t1", "other", "blob9") == 1
    assert _add(sessions, "t2", "news", "blob8") == 1
    assert repos.delete_version(sessions, "t1", "news", 3) == "blob2"
    assert _add(sessions, "t1", "news", "blob3") == 4
    version = repos.get_version(sessions, "t1", "news", 4)
    assert (version.created_by, version.base_model, version.archived) == ("alice", "base/model", False)
    assert version.to_api()["adapterPath"] == "news/4"
    assert [v["tag"] for v in repos.get_repo(sessions, "t1", "news").to_api()["versions"]] == [1, 2, 4]


def test_archive_and_tenant_isolation(sessions: SessionFactory) -> None:
    _add(sessions, "t1", "news", "blob1")
    assert repos.set_archived(sessions, "t1", "news", 1, True).archived
    assert repos.get_version(sessions, "t1", "news", 1).archived
    for tenant, tag in (("t2", 1), ("t1", 2)):
        with pytest.raises(VersionNotFoundError):
            repos.get_version(sessions, tenant, "news", tag)
    with pytest.raises(RepoNotFoundError):
        repos.delete_repo(sessions, "t2", "news")
    assert repos.delete_repo(sessions, "t1", "news") == ["blob1"]
    assert repos.list_repos(sessions, "t1") == []


def test_concurrent_uploads_get_distinct_consecutive_numbers(sessions: SessionFactory) -> None:
    num_threads = 8
    barrier = threading.Barrier(num_threads)
    numbers: list[int] = []
    errors: list[BaseException] = []

    def upload(idx: int) -> None:
        barrier.wait()  # all threads race for the repo creation and the number at once
        try:
            numbers.append(_add(sessions, "t1", "race", f"blob{idx}"))
        except BaseException as error:  # noqa: BLE001 - reported by the assertion below
            errors.append(error)

    threads = [threading.Thread(target=upload, args=(idx,)) for idx in range(num_threads)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert sorted(numbers) == list(range(1, num_threads + 1))
    assert len(repos.list_repos(sessions, "t1")) == 1
