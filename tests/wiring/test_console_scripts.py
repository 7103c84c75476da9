"""`pip install .` installs the service's commands, `lora-serve` and `lora-serve-cluster`: pyproject
names them, each points at the `main` of the module `python -m` runs, and the installed command
starts that program."""
from __future__ import annotations

import ast
import importlib.metadata
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
COMMANDS = {"lora-serve": "server.__main__:main", "lora-serve-cluster": "server.cluster.__main__:main"}


def _defines_function(module: str, name: str) -> bool:
    """`module`'s file defines `name` at top level (read, not imported: the cluster's imports Ray)."""
    tree = ast.parse((ROOT / (module.replace(".", "/") + ".py")).read_text())
    return any(isinstance(node, ast.FunctionDef) and node.name == name for node in tree.body)


def test_pyproject_names_the_commands_and_their_entry_functions_exist() -> None:
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts == COMMANDS
    for target in scripts.values():
        module, _, function = target.partition(":")
        assert _defines_function(module, function), target


def test_the_installed_project_carries_the_commands() -> None:
    """The environment's install (`make install`) is of the current pyproject: its entry points are
    the commands above (a stale install, made before they were declared, fails here)."""
    installed = {point.name: point.value for point in importlib.metadata.entry_points(group="console_scripts")
                 if point.dist is not None and point.dist.name == "lora-serve"}
    assert installed == COMMANDS


def test_lora_serve_is_the_server_program() -> None:
    command = Path(sys.executable).parent / "lora-serve"
    result = subprocess.run([str(command), "--help"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "--adapter-pool-mib" in result.stdout and "tokens" in result.stdout
    assert result.stdout.startswith("usage: lora-serve "), result.stdout[:200]


def test_the_module_names_itself_as_typed() -> None:
    result = subprocess.run([sys.executable, "-m", "server", "--help"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.startswith("usage: python -m server "), result.stdout[:200]
