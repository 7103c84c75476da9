"""Where benchmarks keep their figures: one JSON report per run, in `benchmarks/results/` unless the
run names another directory, under a name that says what was measured and how (`results_stem`),
with its plot beside it when the benchmark draws one."""
from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

RESULTS_DIR = Path(__file__).parent / "results"

logger = logging.getLogger(__name__)


def results_stem(benchmark: str, *qualifiers: str, quick: bool = False) -> str:
    """`prefix_bfloat16_1t_quick`: the benchmark, what the run used, `_quick` for a cut run (so a
    quick run never overwrites a full one's figures)."""
    return "_".join((benchmark, *qualifiers)) + ("_quick" if quick else "")


def write_results(report: Mapping[str, Any], directory: Path, stem: str,
                  plot: Callable[[Path], None] | None = None) -> Path:
    """`directory/stem.json` (the directory made if missing), and `plot(directory/stem.png)` when
    given; returns the JSON's path."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{stem}.json"
    path.write_text(json.dumps(report, indent=1))
    if plot is not None:
        plot(path.with_suffix(".png"))
    logger.info("wrote %s%s", path, " and its plot" if plot is not None else "")
    return path
