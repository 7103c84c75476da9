"""The layering rules of docs/architecture.md, read from the source: what each product module imports
(module level and inside functions), and which of those imports break a rule."""
from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PRODUCT_PACKAGES = ("kernels", "lora_runtime", "server")

# The runtime's contract with the service: the only runtime modules `server/` imports.
CONTRACT = frozenset({"lora_runtime.api", "lora_runtime.adapter_files"})
# Server modules that build or place the engine, and what else of the runtime each may import.
ENTRY_POINTS = {
    "server/__main__.py": "builds the engine of `python -m server`",
    "server/launch.py": "turns the command line into the engine's EngineConfig",
    "server/cluster/replica.py": "builds each replica's engine",
    "server/adapter_sources.py": "builds the engine's adapter sources (hub, s3, local, pbase)",
    "server/cpu_placement.py": "reads the machine's cores for the engine's threads",
    "server/registry/blobs.py": "reads the registry's S3 bucket with the s3 source's client",
    "server/registry/layout.py": "converts an uploaded .bin with the runtime's checked reader",
    "server/registry/source.py": "the pbase adapter source, on the sources' shared download store",
}


def imported_modules(path: Path) -> Iterator[str]:
    """Every module `path` imports by an absolute name (`from package import name` yields `package`,
    which is what a rule judges)."""
    tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.module


def violations(path: Path, relative: str) -> list[str]:
    """The rules `relative` (its path under the repository root) breaks, one line each."""
    layer = relative.split("/", 1)[0]
    found = []
    for module in set(imported_modules(path)):
        top = module.split(".", 1)[0]
        if top in ("tests", "benchmarks") and layer in PRODUCT_PACKAGES:
            found.append(f"{relative}: product code imports {module}")
        elif layer == "benchmarks" and top == "tests":
            found.append(f"{relative}: a benchmark imports {module} (what benchmarks share lives in benchmarks/)")
        elif layer == "kernels" and top in ("lora_runtime", "server"):
            found.append(f"{relative}: kernels import {module}, a layer above them")
        elif layer == "lora_runtime" and top == "server":
            found.append(f"{relative}: the runtime imports {module}, the layer above it")
        elif layer == "server" and top == "lora_runtime" and not _server_may_import(relative, module):
            found.append(f"{relative}: imports {module}, not the runtime's contract ({', '.join(sorted(CONTRACT))})")
    return sorted(found)


def _server_may_import(relative: str, module: str) -> bool:
    if relative in ENTRY_POINTS:
        return True
    return module in CONTRACT


def checked_files() -> Iterator[tuple[Path, str]]:
    """The product's modules and the benchmarks'."""
    for package in (*PRODUCT_PACKAGES, "benchmarks"):
        for path in sorted((ROOT / package).rglob("*.py")):
            yield path, path.relative_to(ROOT).as_posix()
