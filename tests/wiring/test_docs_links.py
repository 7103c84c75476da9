"""README.md and docs/*.md stay true to the tree: every relative link names a file that exists (and,
with `#anchor`, a heading of that file), every `make <target>` a target of the Makefile, and every
`python -m <module>` a module of the repository. The README stays a short page for users: at most
160 lines, none over 200 characters, and no history of the work (no issue numbers, no sessions)."""
from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
_CODE = re.compile(r"^```[^\n]*\n(.*?)^```|`([^`\n]+)`", re.MULTILINE | re.DOTALL)
# In code: `make [VAR=value ...] target`, as a command of its own or after `&&` / `;`.
_MAKE = re.compile(r"(?:^|&&|;)\s*make((?:\s+[A-Z_]+=\S*)*)\s+([a-z][\w-]*)", re.MULTILINE)
_PYTHON_M = re.compile(r"\bpython(?:3(?:\.\d+)?)? -m ([A-Za-z_][\w.]*)")
_MAKE_TARGET = re.compile(r"^([\w.-]+(?:\s+[\w.-]+)*)\s*:(?!=)", re.MULTILINE)
_HISTORY = re.compile(r"\bissues? #?\d+|\b(?:first|second|third|\w+th) session\b|\bround \d+", re.IGNORECASE)
HISTORY_FREE_PAGES = [README, *(ROOT / "docs" / name for name in ("serving.md", "cluster.md", "library.md", "benchmarks.md"))]


def heading_anchors(text: str) -> set[str]:
    """GitHub's anchors for a page's headings: lower case, punctuation but `-` and `_` dropped,
    spaces to dashes."""
    anchors = set()
    for line in text.splitlines():
        if match := re.match(r"#{1,6} (.+)", line):
            title = re.sub(r"[^\w\- ]", "", match.group(1).strip().lower())
            anchors.add(title.replace(" ", "-"))
    return anchors


def relative_links(text: str) -> list[str]:
    return [target for target in _LINK.findall(text) if not re.match(r"[a-z]+:", target)]


def make_targets() -> set[str]:
    makefile = (ROOT / "Makefile").read_text()
    return {name for match in _MAKE_TARGET.finditer(makefile) for name in match.group(1).split()}


def code(text: str) -> list[str]:
    """The page's code: fenced blocks and inline spans, where commands are written."""
    return [block or span for block, span in _CODE.findall(text)]


def named_make_targets(text: str) -> set[str]:
    return {match.group(2) for snippet in code(text) for match in _MAKE.finditer(snippet)}


def named_modules(text: str) -> set[str]:
    return {name.rstrip(".") for snippet in code(text) for name in _PYTHON_M.findall(snippet)}


def is_repository_module(name: str) -> bool:
    """`name` is the standard library's (`python -m venv`) or resolves to a file of this repository,
    found without importing the module itself (its parent packages' `__init__` do run: they are
    light, and `server/` needs no torch)."""
    if name.partition(".")[0] in sys.stdlib_module_names:
        return True
    try:
        spec = importlib.util.find_spec(name)
    except ModuleNotFoundError:  # a parent package is missing
        return False
    if spec is None or spec.origin is None:
        return False
    origin = Path(spec.origin).resolve()  # the repository's own tree, not its .venv
    return origin.is_relative_to(ROOT) and origin.relative_to(ROOT).parts[0] == name.partition(".")[0]


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.name)
def test_every_relative_link_resolves(page: Path) -> None:
    broken = []
    for target in relative_links(page.read_text()):
        path_part, _, anchor = target.partition("#")
        linked = (page.parent / path_part).resolve() if path_part else page
        if not linked.exists():
            broken.append(target)
        elif anchor and linked.suffix == ".md" and anchor not in heading_anchors(linked.read_text()):
            broken.append(target)
    assert not broken, f"{page.name} links to what does not exist: {broken}"


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.name)
def test_every_make_target_named_exists(page: Path) -> None:
    missing = named_make_targets(page.read_text()) - make_targets()
    assert not missing, f"{page.name} names make targets the Makefile lacks: {sorted(missing)}"


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.name)
def test_every_python_module_named_exists(page: Path) -> None:
    missing = {name for name in named_modules(page.read_text()) if not is_repository_module(name)}
    assert not missing, f"{page.name} names `python -m` modules that are not in the repository: {sorted(missing)}"


def test_the_readme_is_a_short_page() -> None:
    lines = README.read_text().splitlines()
    assert len(lines) <= 160, f"README.md has {len(lines)} lines; its details belong in docs/"
    long_lines = [number for number, line in enumerate(lines, 1) if len(line) > 200]
    assert not long_lines, f"README.md lines over 200 characters: {long_lines}"


@pytest.mark.parametrize("page", HISTORY_FREE_PAGES, ids=lambda page: page.name)
def test_no_history_of_the_work(page: Path) -> None:
    found = _HISTORY.findall(page.read_text())
    assert not found, f"{page.name} tells the history of the work (it lives in git): {found}"


def test_the_checks_catch_what_they_look_for() -> None:
    """Each rule finds its case in a page written to break it: the tests above cannot pass by
    finding nothing."""
    text = ("# Quick start: the API\nSee [the doc](guide/nowhere.md), [a heading](#quick-start-the-api) "
            "and [a site](https://example.com).\nRun `make servee`, then `make PORT=1 test`, `cd x && make install` "
            "and `python -m server.nowhere` or\n```bash\npython3.11 -m benchmarks.engine\n```\n"
            "To make room (`make PYTHON=python3` picks another), as issue 43 said.\n")
    assert relative_links(text) == ["guide/nowhere.md", "#quick-start-the-api"]
    assert "quick-start-the-api" in heading_anchors(text)
    assert named_make_targets(text) == {"servee", "test", "install"}
    assert "servee" not in make_targets() and {"serve", "test", "install"} <= make_targets()
    assert named_modules(text) == {"server.nowhere", "benchmarks.engine"}
    assert not is_repository_module("server.nowhere") and is_repository_module("benchmarks.engine")
    assert is_repository_module("venv") and not is_repository_module("pytest")  # installed, not ours
    assert _HISTORY.findall(text) == ["issue 43"]
