"""The layers hold: `server/` imports of the runtime only its contract (`lora_runtime.api`,
`lora_runtime.adapter_files`; the modules that build the engine, listed
in `tests/wiring/layers.py` with why), `kernels/` imports nothing above it, the runtime nothing of the
server, no product code imports `benchmarks/` or `tests/`, and no benchmark imports `tests/`. The negative tests show the checker
refusing each kind of forbidden import written into a file."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.wiring.layers import ENTRY_POINTS, ROOT, checked_files, violations


def test_every_product_module_keeps_its_layer() -> None:
    found = [line for path, relative in checked_files() for line in violations(path, relative)]
    assert not found, "\n".join(found)


def test_every_listed_entry_point_exists() -> None:
    assert all((ROOT / relative).is_file() for relative in ENTRY_POINTS)


@pytest.mark.parametrize(("relative", "line", "refusal"), [
    ("server/routes/service.py", "from lora_runtime.engine import Engine", "not the runtime's contract"),
    ("server/routes/service.py", "from lora_runtime import AsyncEngine", "not the runtime's contract"),
    ("server/serving.py", "    from lora_runtime.adapters.manager import AdapterManager", "not the runtime's contract"),
    ("server/openai_api/tools.py", "from lora_runtime.sampling.schema import JSON_COMPILE_OPTIONS", "not the runtime's contract"),
    ("kernels/linear.py", "import lora_runtime.config", "a layer above them"),
    ("kernels/linear.py", "from server.errors import ApiError", "a layer above them"),
    ("lora_runtime/engine.py", "from server.errors import ApiError", "the layer above it"),
    ("lora_runtime/engine.py", "from tests.engine.factories import make_engine", "product code imports"),
    ("server/app.py", "from benchmarks.options import add_threads", "product code imports"),
    ("benchmarks/engine.py", "from tests.engine.factories import make_engine", "a benchmark imports"),
])
def test_a_forbidden_import_is_refused(tmp_path: Path, relative: str, line: str, refusal: str) -> None:
    """The module as it is, with one forbidden import added (at module level, or inside a function
    where it is indented), fails the check."""
    source = (ROOT / relative).read_text()
    if line.startswith(" "):
        source += f"\n\ndef _added() -> None:\n{line}\n"
    else:
        source += f"\n{line}\n"
    edited = tmp_path / "module.py"
    edited.write_text(source)
    assert violations(ROOT / relative, relative) == []
    found = violations(edited, relative)
    assert len(found) == 1 and refusal in found[0] and relative in found[0], found
