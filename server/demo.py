"""The demo adapters of a first start: each `demo_adapters/<name>/` PEFT directory becomes the
`pbase` repo `<name>`, version 1, of tenant `demo`, so `"adapter_id": "<name>/1"` works at once."""
from __future__ import annotations

import logging
import shutil
import tempfile
from pathlib import Path

from lora_runtime.adapter_files import ADAPTER_CONFIG_FILE as CONFIG_FILE
from lora_runtime.api import EngineError
from server.registry.errors import RegistryError
from server.registry.service import AdapterRegistry

logger = logging.getLogger(__name__)


def register_demo_adapters(registry: AdapterRegistry, directory: Path | None, tenant: str) -> list[str]:
    """Registers every adapter directory under `directory` (sorted by name); returns the repo names.

    An adapter the engine refuses is logged and skipped: the server still starts without it.
    """
    if directory is None or not directory.is_dir():
        return []
    names = []
    for adapter_dir in sorted(p for p in directory.iterdir() if (p / CONFIG_FILE).is_file()):
        # The registry normalizes files in place (bin -> safetensors): hand it a copy.
        with tempfile.TemporaryDirectory(prefix="demo-adapter-") as scratch:
            copy = Path(scratch) / "adapter"
            shutil.copytree(adapter_dir, copy, ignore=shutil.ignore_patterns(".*", "README*"))
            try:
                version = registry.create_version(tenant, tenant, adapter_dir.name, copy,
                                                  description=f"demo adapter {adapter_dir.name}")
            except (EngineError, RegistryError) as error:
                logger.warning("demo adapter %s not registered: %s", adapter_dir.name, error.message)
                continue
        logger.info("registered demo adapter %s/%d", version.repo, version.tag)
        names.append(version.repo)
    return names
