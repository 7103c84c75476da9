"""docs/architecture.md stays true to the tree: it names every product module (every .py of
kernels/, lora_runtime/ and server/ but the `__init__.py` files, and the C++ sources of
kernels/csrc/), and every module it names exists. A module is named by its path from the repository
root, or by its file name in the bullet whose first name is its directory (`kernels/backends/`)."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "architecture.md"
PRODUCT_PACKAGES = ("kernels", "lora_runtime", "server")
_NAME = re.compile(r"`([\w./-]+)`")
_MODULE_SUFFIXES = (".py", ".cpp", ".h")


def product_modules() -> set[str]:
    modules = {str(p.relative_to(ROOT)) for package in PRODUCT_PACKAGES
               for p in (ROOT / package).rglob("*.py") if p.name != "__init__.py"}
    return modules | {str(p.relative_to(ROOT)) for p in (ROOT / "kernels" / "csrc").iterdir()
                      if p.suffix in (".cpp", ".h")}


def named_modules(text: str) -> set[str]:
    """The module paths `text` names, by the rule of this file's docstring."""
    named = set()
    for line in text.splitlines():
        names = _NAME.findall(line)
        directory = names[0] if line.startswith("- ") and names and names[0].endswith("/") else None
        for name in names:
            if name.startswith(PRODUCT_PACKAGES) and name.endswith(_MODULE_SUFFIXES):
                named.add(name)
            elif directory and "/" not in name and name.endswith(_MODULE_SUFFIXES):
                named.add(directory + name)
    return named


def test_named_modules_follow_the_rule():
    text = ("- `kernels/backends/`: `cpu_backend.py`, and `kernels/linear.py`.\n"
            "- `server/app.py`: calls `create_app` in `bridge.py`.\n")
    assert named_modules(text) == {"kernels/backends/cpu_backend.py", "kernels/linear.py", "server/app.py"}


def test_every_product_module_is_named():
    missing = product_modules() - named_modules(DOC.read_text())
    assert not missing, f"docs/architecture.md names no line for: {sorted(missing)}"


def test_every_named_module_exists():
    stale = {name for name in named_modules(DOC.read_text()) if not (ROOT / name).is_file()}
    assert not stale, f"docs/architecture.md names modules that do not exist: {sorted(stale)}"


def test_cited_documents_exist():
    """Comments cite the wire decisions and the parameter maths as docs/api.md and
    docs/semantics.md; whatever docs/ file a comment cites is in the repository."""
    cited = set()
    for package in (*PRODUCT_PACKAGES, "tests", "benchmarks"):
        for path in (ROOT / package).rglob("*.py"):
            cited.update(re.findall(r"\bdocs/[\w-]+\.md\b", path.read_text()))
    assert {"docs/api.md", "docs/semantics.md"} <= cited
    assert all((ROOT / name).is_file() for name in cited), sorted(cited)
