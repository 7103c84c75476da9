"""The layout of an uploaded adapter directory, normalized before anything is recorded.

Top-level files are the adapter; `checkpoint-<N>/` subfolders (the layout training tools write) are
checkpoints N. Without top-level adapter files the highest checkpoint is the version's adapter.
`adapter_model.bin` is converted to safetensors by the engine's own reader (`torch.load` with
`weights_only=True`, which refuses pickled code), so only tensors ever reach the store and a bad
file gets the same message as through any adapter source.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from safetensors.torch import save_file

from lora_runtime.adapters.peft_format import read_bin_tensors
from lora_runtime.adapter_files import ADAPTER_CONFIG_FILE, ADAPTER_FILES
from lora_runtime.api import AdapterInvalidError, ValidationError

CHECKPOINT_DIR = re.compile(r"checkpoint-([0-9]{1,9})")
UPLOAD_NAME = re.compile(r"(?:checkpoint-[0-9]{1,9}/)?[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
# Checkpoint folders of one version, unless the registry is given another bound (--max-upload-checkpoints).
MAX_CHECKPOINTS = 32

# Checks one adapter directory; raises AdapterInvalidError / AdapterIncompatibleError when it is bad.
AdapterValidator = Callable[[Path], object]


@dataclass(frozen=True, slots=True)
class AdapterLayout:
    main: Path
    checkpoints: dict[int, Path]
    base_model: str


def check_upload_name(name: str) -> str:
    """A file name a client may upload: an adapter file, optionally inside `checkpoint-<N>/`."""
    if not UPLOAD_NAME.fullmatch(name) or name.rsplit("/", 1)[-1] not in ADAPTER_FILES:
        raise ValidationError("file", f"{name!r} is not an adapter file name")
    return name


def read_layout(directory: Path, validate: AdapterValidator, max_checkpoints: int = MAX_CHECKPOINTS) -> AdapterLayout:
    """Normalizes (bin -> safetensors) and validates every adapter in `directory`.

    Raises:
        AdapterInvalidError: unexpected entries, no adapter, a pickle that is not plain tensors, or
            whatever `validate` raises for one of the adapters.
    """
    checkpoints = _checkpoint_dirs(directory, max_checkpoints)
    has_main = (directory / ADAPTER_CONFIG_FILE).is_file()
    if not has_main and not checkpoints:
        raise AdapterInvalidError(f"the upload has no {ADAPTER_CONFIG_FILE}")
    main = directory if has_main else checkpoints[max(checkpoints)]
    for adapter_dir in {main, *checkpoints.values()}:
        _convert_bin_weights(adapter_dir)
        validate(adapter_dir)
    return AdapterLayout(main=main, checkpoints=checkpoints, base_model=_base_model(main))


def _checkpoint_dirs(directory: Path, max_checkpoints: int) -> dict[int, Path]:
    checkpoints: dict[int, Path] = {}
    for entry in directory.iterdir():
        match = CHECKPOINT_DIR.fullmatch(entry.name)
        if match and entry.is_dir() and not entry.is_symlink():
            checkpoints[int(match[1])] = entry
        elif entry.name not in ADAPTER_FILES or not entry.is_file() or entry.is_symlink():
            raise AdapterInvalidError(f"unexpected entry in the upload: {entry.name!r}")
    if len(checkpoints) > max_checkpoints:
        raise AdapterInvalidError(f"more than {max_checkpoints} checkpoints")
    return checkpoints


def _convert_bin_weights(adapter_dir: Path) -> None:
    """Replaces `adapter_model.bin` by `adapter_model.safetensors` (kept if both were uploaded)."""
    bin_path = adapter_dir / "adapter_model.bin"
    if not bin_path.is_file():
        return
    safetensors_path = adapter_dir / "adapter_model.safetensors"
    if not safetensors_path.exists():
        state = read_bin_tensors(bin_path)
        # Clones: safetensors refuses tensors that share storage, which torch.save keeps.
        save_file({name: t.detach().clone().contiguous() for name, t in state.items()}, safetensors_path)
    bin_path.unlink()


def _base_model(adapter_dir: Path) -> str:
    try:
        config = json.loads((adapter_dir / ADAPTER_CONFIG_FILE).read_text())
    except (OSError, ValueError) as error:
        raise AdapterInvalidError(f"{ADAPTER_CONFIG_FILE} is not valid JSON ({type(error).__name__})") from None
    base_model = config.get("base_model_name_or_path") if isinstance(config, dict) else None
    return base_model if isinstance(base_model, str) else ""
