"""`python -m server tenants ...` and `tokens ...` run as a user runs them: a subprocess for the order
of the options (before, between or after the command), and `main` with the same argv, in this
process, for the rest (a subprocess costs a second or more each). The oracle is the database the
server authenticates with (`tenant_of_token`) and the commands' own listings."""
from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from server.__main__ import _parser, main
from server.db import open_database
from server.registry.models import RegistryBase
from server.registry.repos import create_repo
from server.launch import server_config
from server.tenancy import tenant_of_token

REPO_ROOT = Path(__file__).resolve().parents[2]


def _run(*argv: str) -> str:
    """`python -m server ARGV` in a subprocess: its stdout."""
    done = subprocess.run([sys.executable, "-m", "server", *argv], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=120, env={"PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr
    return done.stdout


def _main(capsys, *argv: str, expect_rc: int = 0) -> tuple[str, str]:
    """`main(ARGV)` in this process: stdout and stderr; `sys.exit(message)` is exit status 1 with the
    message on stderr, as Python prints it."""
    code: int | str | None = 0
    try:
        main(list(argv))
    except SystemExit as exited:
        code = exited.code
    captured = capsys.readouterr()
    status, err = (1, captured.err + code) if isinstance(code, str) else (code or 0, captured.err)
    assert status == expect_rc, err
    return captured.out, err


def _tenant_of(data_dir: Path, token: str) -> str | None:
    database = open_database(f"sqlite:///{data_dir / 'state.db'}")
    try:
        return tenant_of_token(database, token)
    finally:
        database.dispose()


def _placed(data_dir: Path, command: str, action: str, *rest: str, where: str) -> list[str]:
    """The command line with `--data-dir` before the command, between it and its action, or last."""
    option = ["--data-dir", str(data_dir)]
    return {"before": [*option, command, action, *rest], "between": [command, *option, action, *rest],
            "after": [command, action, *rest, *option]}[where]


@pytest.mark.parametrize("where", ["before", "between", "after"])
def test_the_commands_take_the_database_option_in_any_order(tmp_path: Path, where: str) -> None:
    _run(*_placed(tmp_path, "tenants", "create", "beta", where=where))
    token = _run(*_placed(tmp_path, "tokens", "create", "--tenant", "acme", where=where)).strip()
    assert _tenant_of(tmp_path, token) == "acme"
    assert _run(*_placed(tmp_path, "tenants", "list", where=where)) == "acme\nbeta\n"
    listed = _run(*_placed(tmp_path, "tokens", "list", where=where)).splitlines()
    assert [line.split("\t")[:2] for line in listed] == [["1", "acme"]]
    _run(*_placed(tmp_path, "tokens", "revoke", "--id", "1", where=where))
    assert _tenant_of(tmp_path, token) is None
    _run(*_placed(tmp_path, "tenants", "delete", "beta", where=where))
    assert _run(*_placed(tmp_path, "tenants", "list", where=where)) == "acme\n"


def test_a_token_is_revoked_by_its_secret_and_listed_per_tenant(tmp_path: Path, capsys) -> None:
    database = ["--data-dir", str(tmp_path)]
    kept = _main(capsys, "tokens", "create", "--tenant", "acme", *database)[0].strip()
    leaked = _main(capsys, "tokens", "create", "--tenant", "beta", *database)[0].strip()
    listed = _main(capsys, "tokens", "list", "--tenant", "beta", *database)[0].splitlines()
    assert [line.split("\t")[:2] for line in listed] == [["2", "beta"]]
    assert leaked not in listed[0]  # the secret is never shown again
    _, said = _main(capsys, "tokens", "revoke", "--token", leaked, *database)
    assert "revoked token 2 of tenant beta" in said
    assert (_tenant_of(tmp_path, leaked), _tenant_of(tmp_path, kept)) == (None, "acme")
    _, refused = _main(capsys, "tokens", "revoke", "--token", leaked, *database, expect_rc=1)
    assert "no such token" in refused


def test_a_deleted_tenants_tokens_stop_working(tmp_path: Path, capsys) -> None:
    database = ["--data-dir", str(tmp_path)]
    token = _main(capsys, "tokens", "create", "--tenant", "acme", *database)[0].strip()
    _main(capsys, "tenants", "delete", "acme", *database)
    assert _tenant_of(tmp_path, token) is None
    assert _main(capsys, "tokens", "list", *database)[0] == ""


def test_a_tenant_with_adapter_repos_is_not_deleted(tmp_path: Path, capsys) -> None:
    token = _main(capsys, "tokens", "create", "--tenant", "acme", "--data-dir", str(tmp_path))[0].strip()
    database = open_database(f"sqlite:///{tmp_path / 'state.db'}", other_metadata=[RegistryBase.metadata])
    create_repo(database.sessions, "acme", "support", "acme")
    database.dispose()
    _, refused = _main(capsys, "tenants", "delete", "acme", "--data-dir", str(tmp_path), expect_rc=1)
    assert "still has adapter repos (support)" in refused
    assert _tenant_of(tmp_path, token) == "acme"


@pytest.mark.parametrize(("argv", "message"), [
    (["tenants", "delete", "nobody"], "no tenant 'nobody'"),
    (["tenants", "create", "Not A Name"], "tenant name 'Not A Name' must match"),
    (["tokens", "revoke", "--id", "7"], "no such token"),
])
def test_mistakes_are_told_in_one_line(tmp_path: Path, capsys, argv: list[str], message: str) -> None:
    _, refused = _main(capsys, *argv, "--data-dir", str(tmp_path), expect_rc=1)
    assert message in refused and "Traceback" not in refused


@pytest.mark.parametrize(("variables", "port", "data_dir"), [
    ([], 8080, ".data"),
    (["PORT=9123", "DATA=/tmp/my data"], 9123, "/tmp/my data"),
])
def test_make_serve_passes_port_and_data_to_the_server(variables: list[str], port: int, data_dir: str) -> None:
    """The command `make serve` would run (make -n runs nothing), read by the server's own parser. Run as
    a make of its own: under `make test` the inherited MAKELEVEL would have it print the directory it
    leaves after the command."""
    env = {name: value for name, value in os.environ.items() if name not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
    printed = subprocess.run(["make", "--no-print-directory", "-n", "serve", *variables], cwd=REPO_ROOT,
                             env=env, capture_output=True, text=True, check=True).stdout.splitlines()[-1]
    argv = shlex.split(printed)
    assert argv[1:3] == ["-m", "server"]
    config = server_config(_parser().parse_args(argv[3:]))
    assert (config.port, config.data_dir) == (port, Path(data_dir))
