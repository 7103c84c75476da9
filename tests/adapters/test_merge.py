"""Merges against PEFT's `add_weighted_adapter` on a tiny random Llama holding several adapters.

Deterministic types must match PEFT bit for bit. For DARE, PEFT draws its masks from the global
generator inside `add_weighted_adapter`, after creating the new adapter (which also draws), so the
oracle is PEFT's own per-module merge (`_generalized_task_arithmetic_weighted_adapter`, which builds
the sqrt-weighted factors and calls `merge_utils.dare_*`), run over the modules in order after seeding
the global generator with our seed."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from peft import LoraConfig, PeftModel
from peft.tuners.lora import LoraLayer

from lora_runtime.adapters import AdapterLimits, LoraWeights, MergedAdapters, load_peft_adapter
from lora_runtime.adapters.loader import AdapterLoader
from lora_runtime.adapters.merge import merge_lora_weights
from lora_runtime.adapters.merge_request import MAX_MERGE_WEIGHT, MAX_MERGED_ADAPTERS
from lora_runtime.adapters.refs import AdapterRef
from lora_runtime.adapters.weights import LoraModuleWeights
from lora_runtime.engine_info import BaseModelShape
from lora_runtime.errors import AdapterIncompatibleError, ValidationError
from tests.adapters.peft_factory import peft_model, randomize_lora, save_adapter, tiny_shape

# Equal ranks (required), different alphas and target subsets; `c` uses rslora (PEFT 0.21.2
# mis-scales a merged rslora adapter by sqrt(r), PR 3449, but its merged factors are right, and
# factors are what we compare).
ADAPTER_CONFIGS = {
    "a": LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]),
    "b": LoraConfig(r=8, lora_alpha=4, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "down_proj"]),
    "c": LoraConfig(r=8, lora_alpha=8, use_rslora=True, target_modules=["v_proj", "gate_proj", "up_proj"]),
}
IDS = ["a", "b", "c"]
WEIGHTS = [0.7, -0.4, 1.3]


@pytest.fixture(scope="module")
def peft_multi(tiny_base) -> PeftModel:
    model = peft_model(tiny_base, ADAPTER_CONFIGS["a"], seed=11, name="a")
    for name in IDS[1:]:
        model.add_adapter(name, ADAPTER_CONFIGS[name])
    randomize_lora(model, seed=12)
    return model


@pytest.fixture(scope="module")
def ours(peft_multi: PeftModel, tmp_path_factory) -> dict[str, LoraWeights]:
    root = tmp_path_factory.mktemp("merge")
    return {
        name: load_peft_adapter(save_adapter(peft_multi, root, name), tiny_shape(), AdapterLimits())
        for name in IDS
    }


def _lora_layers(model: PeftModel) -> list[tuple[tuple[int, str], LoraLayer]]:
    return [
        ((int(name.split("layers.")[1].split(".")[0]), name.rsplit(".", 1)[-1]), module)
        for name, module in model.named_modules()
        if isinstance(module, LoraLayer)
    ]


def _assert_factors_equal(merged: LoraWeights, expected: dict, exact: bool) -> None:
    assert set(merged.modules) == set(expected)
    for key, (lora_a, lora_b) in expected.items():
        module = merged.modules[key]
        assert module.scale == 1.0
        if exact:
            assert torch.equal(module.lora_a, lora_a) and torch.equal(module.lora_b, lora_b), key
        else:
            torch.testing.assert_close(module.lora_a, lora_a, rtol=1e-6, atol=1e-7)
            torch.testing.assert_close(module.lora_b, lora_b, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize(
    ("strategy", "density", "sign_method"),
    [("linear", 1.0, "total"), ("ties", 0.5, "total"), ("ties", 0.3, "frequency"), ("ties", 1.0, "total")],
)
def test_deterministic_merges_equal_peft_add_weighted_adapter(
    peft_multi: PeftModel, ours, strategy: str, density: float, sign_method: str
) -> None:
    merged_name = f"merged_{strategy}_{int(density * 10)}_{sign_method}"
    peft_multi.add_weighted_adapter(
        IDS, WEIGHTS, merged_name, combination_type=strategy, density=density,
        majority_sign_method=sign_method,
    )
    expected = {
        key: (layer.lora_A[merged_name].weight, layer.lora_B[merged_name].weight)
        for key, layer in _lora_layers(peft_multi)
        if merged_name in layer.lora_A
    }
    spec = MergedAdapters(IDS, WEIGHTS, strategy, density, sign_method)
    _assert_factors_equal(merge_lora_weights([ours[name] for name in IDS], spec), expected, exact=True)


@pytest.mark.parametrize(("strategy", "sign_method"), [("dare_linear", "total"), ("dare_ties", "frequency")])
def test_dare_merges_equal_peft_with_the_same_masks(peft_multi, ours, strategy: str, sign_method: str) -> None:
    seed, density = 1234, 0.6
    torch.manual_seed(seed)
    expected = {}
    for key, layer in _lora_layers(peft_multi):
        present = [name for name in IDS if name in layer.lora_A]
        if present:
            expected[key] = peft_multi.base_model._generalized_task_arithmetic_weighted_adapter(
                strategy, IDS, WEIGHTS, layer, density, sign_method
            )
    spec = MergedAdapters(IDS, WEIGHTS, strategy, density, sign_method)
    merged = merge_lora_weights([ours[name] for name in IDS], spec, seed=seed)
    _assert_factors_equal(merged, expected, exact=True)
    again = merge_lora_weights([ours[name] for name in IDS], spec, seed=seed)
    assert all(torch.equal(again.modules[k].lora_a, m.lora_a) for k, m in merged.modules.items())


def test_merge_applies_the_weighted_deltas_for_linear_on_disjoint_modules(ours) -> None:
    """Where only one adapter adapts a module, the merged delta is w * its own delta."""
    spec = MergedAdapters(["a", "b"], [0.5, 2.0])
    merged = merge_lora_weights([ours["a"], ours["b"]], spec)
    key = (1, "o_proj")  # only `b` adapts o_proj
    torch.testing.assert_close(merged.modules[key].delta_weight(), 2.0 * ours["b"].modules[key].delta_weight())


def test_different_ranks_are_refused(tiny_base, tmp_path: Path, ours) -> None:
    other = peft_model(tiny_base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"]), seed=3)
    rank4 = load_peft_adapter(save_adapter(other, tmp_path), tiny_shape(), AdapterLimits())
    with pytest.raises(AdapterIncompatibleError, match=r"merged_adapters.ids: .*different ranks \[4, 8\]"):
        merge_lora_weights([ours["a"], rank4], MergedAdapters(["a", "r4"]))


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        (dict(ids=[]), "merged_adapters.ids"),
        (dict(ids="a"), "merged_adapters.ids"),
        (dict(ids=["a", ""]), "merged_adapters.ids"),
        (dict(ids=["a", "b"], weights=[1.0]), "merged_adapters.weights"),
        (dict(ids=["a"], weights=[float("nan")]), "merged_adapters.weights"),
        (dict(ids=["a"], weights=[float("inf")]), "merged_adapters.weights"),
        (dict(ids=["a", "b"], weights=[1.0, float("-inf")]), "merged_adapters.weights"),
        (dict(ids=["a"], weights=[1e30]), "merged_adapters.weights"),
        (dict(ids=["a"], weights=[1e10]), "merged_adapters.weights"),
        (dict(ids=["a", "b"], weights=[0.5, -1e10]), "merged_adapters.weights"),
        (dict(ids=["a"], weights=[MAX_MERGE_WEIGHT * (1 + 1e-9)]), "merged_adapters.weights"),
        (dict(ids=[f"org/a{idx}" for idx in range(MAX_MERGED_ADAPTERS + 1)]), "merged_adapters.ids"),
        (dict(ids=["org/a"] * (MAX_MERGED_ADAPTERS + 1)), "merged_adapters.ids"),
        (dict(ids=["a"], merge_strategy="svd"), "merged_adapters.merge_strategy"),
        (dict(ids=["a"], merge_strategy="ties", density=0.0), "merged_adapters.density"),
        (dict(ids=["a"], density=1.5), "merged_adapters.density"),
        (dict(ids=["a"], majority_sign_method="mean"), "merged_adapters.majority_sign_method"),
    ],
)
def test_merged_adapters_validation_names_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValidationError) as raised:
        MergedAdapters(**kwargs)
    assert raised.value.field == field


def test_merged_adapters_is_its_own_cache_key() -> None:
    first = MergedAdapters(["a", "b"], merge_strategy="ties", density=0.5)
    second = MergedAdapters(("a", "b"), [1, 1.0], "ties", 0.5)
    assert first == second and hash(first) == hash(second) and first.weights == (1.0, 1.0)
    assert first != MergedAdapters(["a", "b"], merge_strategy="ties", density=0.4)


def test_the_bounds_themselves_are_accepted() -> None:
    ids = [f"org/a{idx}" for idx in range(MAX_MERGED_ADAPTERS)]
    weights = [MAX_MERGE_WEIGHT, -MAX_MERGE_WEIGHT, 0.0, 0] + [1.0] * (MAX_MERGED_ADAPTERS - 4)
    spec = MergedAdapters(ids, weights)
    assert len(spec.ids) == MAX_MERGED_ADAPTERS
    assert spec.weights[:4] == (MAX_MERGE_WEIGHT, -MAX_MERGE_WEIGHT, 0.0, 0.0)


def test_distinct_ids_keep_first_appearance_order() -> None:
    spec = MergedAdapters(["b", "a", "b", "c", "a"], [1.0, 0.5, 2.0, -1.0, 0.1])
    assert spec.distinct_ids == ("b", "a", "c")
    assert spec.ids == ("b", "a", "b", "c", "a")  # the merge itself still sees every entry


def test_a_duplicated_id_merges_as_peft_does_not_as_its_summed_weight(peft_multi: PeftModel, ours) -> None:
    """[a, a] with weights [1, 1] scales both of a's factors by 2 * sqrt(s): 4x a's delta, not 2x."""
    peft_multi.add_weighted_adapter(["a", "a"], [1.0, 1.0], "merged_duplicate", combination_type="linear")
    expected = {
        key: (layer.lora_A["merged_duplicate"].weight, layer.lora_B["merged_duplicate"].weight)
        for key, layer in _lora_layers(peft_multi)
        if "merged_duplicate" in layer.lora_A
    }
    merged = merge_lora_weights([ours["a"], ours["a"]], MergedAdapters(["a", "a"]))
    _assert_factors_equal(merged, expected, exact=True)
    key = (0, "q_proj")
    own_delta = ours["a"].modules[key].delta_weight()
    torch.testing.assert_close(merged.modules[key].delta_weight(), 4.0 * own_delta)


def test_merged_factors_that_overflow_are_refused_with_a_typed_error() -> None:
    """Finite adapters and weights within the bound whose weighted sum overflows fp32."""
    huge = LoraModuleWeights(torch.full((2, 4), 3e38), torch.full((3, 2), 3e38), 1.0)
    adapters = [LoraWeights({(0, "q_proj"): huge}), LoraWeights({(0, "q_proj"): huge})]
    overflow = r"merged_adapters.weights: .*layer 0 q_proj overflow"
    with pytest.raises(AdapterIncompatibleError, match=overflow) as raised:
        merge_lora_weights(adapters, MergedAdapters(["x", "y"], [MAX_MERGE_WEIGHT, 1.0]))
    assert raised.value.error_type == "adapter_incompatible"


def test_a_library_callers_merge_is_parsed_once_where_it_enters(tmp_path: Path) -> None:
    """The loader's `parse` gives a merge its parts (local directories here), which its load reads;
    a bad id is refused there, naming the merge's field."""
    loader = AdapterLoader(BaseModelShape("tiny", 1, {}), AdapterLimits(), {}, allow_local_paths=True)
    (tmp_path / "a").mkdir()
    request = loader.parse(MergedAdapters([str(tmp_path / "a"), "org/b", str(tmp_path / "a")]))
    assert request.parts == (AdapterRef("local", str(tmp_path / "a"), str(tmp_path / "a")),
                             AdapterRef("hub", "org/b", "org/b"))
    assert loader.parse(request) is request  # parts already parsed are kept, not parsed again
    with pytest.raises(ValidationError) as refused:
        loader.parse(MergedAdapters(["a/1", "bad\nid"]))
    assert refused.value.field == "merged_adapters.ids"
