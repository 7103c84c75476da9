"""The install is a real package: pyproject.toml declares what requirements.txt installs (section by
section, versions included), every third-party module the product imports is declared, and the
client library imports without torch."""
from __future__ import annotations

import ast
import importlib.metadata
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]
PRODUCT_PACKAGES = ("kernels", "lora_runtime", "server")
_SECTION = re.compile(r"#\s*\[(runtime|extra (\S+))\]")


def _requirement_set(lines: list[str]) -> dict[str, Requirement]:
    requirements = [Requirement(line) for line in lines]
    by_name = {canonicalize_name(r.name): r for r in requirements}
    assert len(by_name) == len(requirements), f"a package is named twice in {lines}"
    return by_name


def requirements_sections(text: str) -> dict[str, dict[str, Requirement]]:
    """requirements.txt's sections: "runtime" and each extra's name, to its requirements by name."""
    sections: dict[str, list[str]] = {}
    current = None
    for line in text.splitlines():
        if match := _SECTION.match(line):
            current = match.group(2) or "runtime"
            sections.setdefault(current, [])
        elif line.strip() and not line.startswith("#"):
            assert current is not None, f"{line!r} stands before the first section"
            sections[current].append(line.strip())
    return {name: _requirement_set(lines) for name, lines in sections.items()}


def pyproject_sections() -> dict[str, dict[str, Requirement]]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project.get("optional-dependencies", {})
    return {"runtime": _requirement_set(project["dependencies"]),
            **{name: _requirement_set(lines) for name, lines in extras.items()}}


def _as_comparable(section: dict[str, Requirement]) -> dict[str, tuple]:
    return {name: (r.specifier, frozenset(r.extras), r.marker) for name, r in section.items()}


def test_pyproject_declares_what_requirements_installs():
    from_requirements = requirements_sections((ROOT / "requirements.txt").read_text())
    from_pyproject = pyproject_sections()
    assert from_requirements.keys() == from_pyproject.keys() >= {"runtime", "triton", "test"}
    # The schema route's grammar engine, once missing from pyproject: the parse finds it.
    assert "llguidance" in from_pyproject["runtime"]
    for section in from_pyproject:
        assert _as_comparable(from_requirements[section]) == _as_comparable(from_pyproject[section]), section


def _imported_top_level_modules(package_dir: Path) -> set[str]:
    modules = set()
    for path in package_dir.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                modules.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                modules.add(node.module.split(".")[0])
    return modules


def test_every_third_party_import_of_the_product_is_declared():
    """A module the product imports comes from a distribution that `pip install .` (or a non-test
    extra: triton) brings: a `pip install .` must not give a server that fails on first use."""
    declared = {name for section, requirements in pyproject_sections().items() if section != "test"
                for name in requirements}
    modules = set().union(*(_imported_top_level_modules(ROOT / p) for p in PRODUCT_PACKAGES))
    third_party = modules - set(sys.stdlib_module_names) - set(PRODUCT_PACKAGES) - {"__future__"}
    distributions = importlib.metadata.packages_distributions()
    undeclared = {module: distributions.get(module) for module in third_party
                  if not {canonicalize_name(d) for d in distributions.get(module, [])} & declared}
    assert not undeclared, f"imported but not in pyproject's dependencies: {undeclared}"


def test_client_library_imports_without_torch():
    """`server.client` is what a caller installs to talk to the service: no engine, no torch."""
    code = "import sys; sys.modules['torch'] = None; import server.client"
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_the_contract_and_the_client_load_no_torch() -> None:
    """The runtime's contract (`lora_runtime.api`, `lora_runtime.adapter_files`) and the client
    library import without loading torch (nor the engine, nor the kernels)."""
    code = ("import sys, lora_runtime.api, lora_runtime.adapter_files, server.client; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'kernels')))")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_the_installed_project_imports_from_any_directory(tmp_path) -> None:
    """`make install` installs the project (editable) into its environment: the library imports with
    no help from the current directory or PYTHONPATH (before, only from the repository's root)."""
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    script = "import kernels, lora_runtime, server.app; print(lora_runtime.__name__)"
    result = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "lora_runtime"
