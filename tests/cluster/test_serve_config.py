"""The documented Serve config file builds the application it describes (no Ray instance needed:
building binds deployments, it starts nothing)."""
from __future__ import annotations

import importlib
from pathlib import Path

import pytest
import yaml

CONFIG = Path(__file__).resolve().parents[2] / "docs" / "serve-config.yaml"


def test_documented_config_builds_the_application(tmp_path: Path) -> None:
    from ray.serve import Application

    (app,) = yaml.safe_load(CONFIG.read_text())["applications"]
    module, name = app["import_path"].split(":")
    build = getattr(importlib.import_module(module), name)
    # Where the documented file names a PostgreSQL server and a data directory of its own, this
    # machine's stand-ins; every other option as documented.
    args = {**app["args"], "database_url": f"sqlite:///{tmp_path / 'state.db'}", "data_dir": str(tmp_path)}
    application = build(args)
    assert isinstance(application, Application)
    assert (tmp_path / "state.db").is_file()  # the schema made before any replica starts


def test_unknown_options_are_refused() -> None:
    from server.cluster.app import build_app

    with pytest.raises(SystemExit):
        build_app({"replica": 2})
