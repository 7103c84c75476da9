"""The packages that export their names lazily (lora_runtime/lazy_exports.py): every exported name
resolves to its defining module's object and is kept after the first read, a typo is refused as a
plain module refuses it, and importing the packages loads no torch until an engine name is read."""
from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]
LAZY_PACKAGES = ("lora_runtime", "lora_runtime.adapters", "lora_runtime.sampling")


@pytest.mark.parametrize("package_name", LAZY_PACKAGES)
def test_every_exported_name_is_its_home_modules_object(package_name: str) -> None:
    package = importlib.import_module(package_name)
    assert package.__all__, package_name
    star: dict[str, object] = {}
    exec(f"from {package_name} import *", star)  # reads every name of __all__
    for name in package.__all__:
        home = importlib.import_module(package._HOMES[name])
        assert star[name] is getattr(home, name) is getattr(package, name), name
        assert vars(package)[name] is star[name], f"{name} not kept after its first read"


@pytest.mark.parametrize("package_name", LAZY_PACKAGES)
def test_an_unknown_name_is_refused_naming_the_module(package_name: str) -> None:
    package = importlib.import_module(package_name)
    with pytest.raises(AttributeError, match=f"^module '{package_name}' has no attribute 'Engien'$"):
        package.Engien
    assert not hasattr(package, "Engien")


def test_the_packages_load_no_torch_until_an_engine_name_is_read() -> None:
    code = ("import sys, lora_runtime, lora_runtime.adapters, lora_runtime.sampling\n"
            "torch_loaded = lambda: 'torch' in sys.modules\n"
            "print(torch_loaded())\n"
            "lora_runtime.SamplingParams, lora_runtime.adapters.AdapterRef  # the torch-free contract\n"
            "print(torch_loaded())\n"
            "lora_runtime.Engine\n"
            "print(torch_loaded())\n")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == ["False", "False", "True"]
