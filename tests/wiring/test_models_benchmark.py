"""`python -m benchmarks.models`: the adapters it writes itself are what PEFT reads (PEFT is the oracle
of the layout), and the benchmark runs end to end on the 1B shape cut to 2 layers, its budget and
peak RSS reported."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from benchmarks import models
from tests.engine.factories import save_tiny_model


def test_written_adapters_load_in_peft_with_every_projection(tmp_path: Path) -> None:
    from peft import PeftModel

    base = save_tiny_model("llama", tmp_path)
    paths = models.write_random_adapters(tmp_path, 2)
    peft_model = PeftModel.from_pretrained(base, str(paths[1]))
    saved = load_file(paths[1] / "adapter_model.safetensors")
    assert len(saved) == 2 * 7 * 2  # A and B, seven projections, two layers
    for key, tensor in saved.items():
        module_key = key.removesuffix(".weight").replace("lora_A", "lora_A.default").replace("lora_B", "lora_B.default")
        loaded = peft_model.get_submodule(module_key).weight
        assert torch.equal(loaded.to(tensor.dtype), tensor), key
    assert peft_model.peft_config["default"].r == models.RANKS[1]


@pytest.mark.slow
def test_models_benchmark_reports_load_budget_and_runs() -> None:
    report = models.main(["--layers", "2", "--concurrency", "1,2", "--new-tokens", "2", "--adapters", "2",
                          "--repeats", "1"])
    ours = report["ours"]
    assert set(ours["runs"]) == {"base@1", "W@1", "base@2", "W@2"}
    assert all(run["tokens"] == count * 2 and run["ttft_s"] > 0
               for name, run in ours["runs"].items() for count in [int(name.split("@")[1])])
    budget = ours["budget"]
    assert budget["total_bytes"] == sum(budget[name] for name in ("weights_bytes", "kv_cache_bytes",
                                                                   "adapter_pool_bytes", "overhead_bytes"))
    assert ours["load_s"] > 0 and ours["peak_rss_over_budget"] == pytest.approx(
        ours["peak_rss_mib"] * 2**20 / budget["total_bytes"])
