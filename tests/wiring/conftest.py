"""One live server wired to every adapter source, shared by this package's modules (one xdist
group, so one worker starts it once): the embedded model in float32; a hub-protocol server and a
moto S3 server on loopback; a local adapter directory; the registry in the data directory.

The adapters are real PEFT LoRA adapters for the embedded model's shapes, written by PEFT's
`save_pretrained` on a two-layer Llama of the same widths (so they touch layers 0 and 1 only)."""
from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from lora_runtime.adapter_files import ADAPTER_FILES
from tests.fixtures.adapters import make_lora_adapter, read_file_bytes
from benchmarks.loopback_hub import HubRepo, HubServer
from benchmarks.loopback_s3 import S3Server, s3_server
from tests.server.live import LiveServer, start_live_server

GROUP = pytest.mark.xdist_group("wiring")
BUCKET = "wiring-adapters"
HUB_TOKEN = "hf_reader"
PROMPT = "The capital of France is"
NUM_NEW_TOKENS = 6


def make_embedded_adapter(directory: Path, seed: int, rank: int = 4) -> Path:
    """A random LoRA adapter (q, v, o projections) that fits the embedded SmolLM2-135M."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    from lora_runtime.embedded import ensure_embedded_model

    config = json.loads((ensure_embedded_model() / "config.json").read_text())
    widths = {k: config[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads",
                                     "num_key_value_heads")}
    torch.manual_seed(seed)
    base = LlamaForCausalLM(LlamaConfig(**widths, num_hidden_layers=2, vocab_size=64))
    # layers_to_transform: PEFT on the full model must not add (random) factors to other layers.
    lora = LoraConfig(r=rank, lora_alpha=4 * rank, target_modules=["q_proj", "v_proj", "o_proj"],
                      layers_to_transform=[0, 1], init_lora_weights=False)
    model = get_peft_model(base, lora)
    model.peft_config["default"].base_model_name_or_path = "HuggingFaceTB/SmolLM2-135M-Instruct"
    model.save_pretrained(directory, save_embedding_layers=False)
    return directory


@dataclass
class Wired:
    live: LiveServer
    hub: HubServer
    s3: S3Server
    adapters: dict[str, Path]  # name -> PEFT directory: a, b (embedded shapes), tiny (another model)

    def generate(self, parameters: dict, tenant: str = "demo", inputs: str = PROMPT):
        import httpx

        body = {"inputs": inputs, "parameters": {"max_new_tokens": NUM_NEW_TOKENS, "details": True,
                                                 **parameters}}
        return httpx.post(self.live.prefix(tenant) + "/generate", json=body,
                          headers=self.live.headers(tenant), timeout=120)


class _FlakyHub(HubServer):
    """The hub fixture, except that repos under `down/` answer 503 (a hub that is unavailable)."""

    def answer(self, method: str, raw_path: str, authorization: str | None):
        if "/down/" in raw_path:
            return 503, {"Content-Type": "application/json"}, b'{"error": "unavailable"}'
        return super().answer(method, raw_path, authorization)


def _fill_hub(hub: HubServer, adapters: dict[str, Path]) -> None:
    def files(name: str) -> dict[str, bytes]:
        return {k: v for k, v in read_file_bytes(adapters[name]).items() if k in ADAPTER_FILES}

    for name in ("a", "b", "tiny"):
        hub.repos[f"org/adapter-{name}"] = HubRepo("public")
        hub.repos[f"org/adapter-{name}"].add_commit({**files(name), "README.md": b"# card"})
    hub.repos["org/private-a"] = HubRepo("private", readers=frozenset({HUB_TOKEN}))
    hub.repos["org/private-a"].add_commit(files("a"))
    hub.repos["org/broken"] = HubRepo("public")
    hub.repos["org/broken"].add_commit({**files("a"), "adapter_config.json": b"{not json"})


def _fill_s3(s3: S3Server, adapters: dict[str, Path]) -> None:
    client = s3.client()
    client.create_bucket(Bucket=BUCKET)
    for name, data in read_file_bytes(adapters["a"]).items():
        client.put_object(Bucket=BUCKET, Key=f"adapters/a/{name}", Body=data)


@pytest.fixture(scope="session")
def wired(tmp_path_factory) -> Iterator[Wired]:
    from lora_runtime import Engine, EngineConfig
    from lora_runtime.config import AdapterConfig
    from lora_runtime.embedded import ensure_embedded_model
    from server.adapter_sources import engine_adapter_sources
    from server.config import ServerConfig
    from server.db import open_database

    root = tmp_path_factory.mktemp("wiring")
    adapters = {name: make_embedded_adapter(root / "peft" / name, seed) for name, seed in (("a", 1), ("b", 2))}
    adapters["tiny"] = make_lora_adapter(root / "peft" / "tiny", seed=3)
    shutil.copytree(adapters["a"], root / "local" / "team" / "a")
    hub = _FlakyHub().start()
    _fill_hub(hub, adapters)
    s3 = s3_server()
    _fill_s3(s3, adapters)
    data_dir = root / "data"
    data_dir.mkdir()
    options = dict(hub_endpoint=hub.endpoint, s3_endpoint=s3.endpoint_url, s3_region="us-east-1",
                   adapter_dir=root / "local")
    database = open_database(f"sqlite:///{data_dir / 'state.db'}")
    with pytest.MonkeyPatch.context() as env:
        s3.use_credentials(env)  # boto3 reads the chain when the client is made
        sources = engine_adapter_sources(ServerConfig(data_dir=data_dir, **options), database)
    # The Hugging Face directory that `peft_oracle` loads.
    engine = Engine.from_config(EngineConfig(model=str(ensure_embedded_model()), dtype="float32",
                                             adapters=AdapterConfig(allow_local_paths=False)),
                                adapter_sources=sources)
    live = start_live_server(engine, data_dir, **options)
    yield Wired(live, hub, s3, adapters)
    live.stop()
    hub.stop()
    engine.adapters.close()
    database.dispose()


@pytest.fixture(scope="session")
def peft_oracle(wired):
    """Greedy token ids of HF transformers + PEFT on the embedded model, for adapter `a` alone and
    for PEFT's linear merge of `a` and `b` (weights 1 and 0.5)."""
    import torch
    from peft import PeftModel
    from transformers import AutoTokenizer, LlamaForCausalLM

    from lora_runtime.embedded import ensure_embedded_model

    model_dir = ensure_embedded_model()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    base = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    # Adapter names must not occur in PEFT's "lora_" prefix, so not "a".
    model = PeftModel.from_pretrained(base, str(wired.adapters["a"]), adapter_name="first")
    model.load_adapter(str(wired.adapters["b"]), adapter_name="second")
    model.add_weighted_adapter(["first", "second"], [1.0, 0.5], "merged", combination_type="linear")
    ids = torch.tensor([tokenizer(PROMPT)["input_ids"]])
    expected = {}
    with torch.no_grad():
        for name, adapter in (("a", "first"), ("merged", "merged")):
            model.set_adapter(adapter)
            out = model.generate(ids, max_new_tokens=NUM_NEW_TOKENS, do_sample=False)
            expected[name] = out[0, ids.shape[1]:].tolist()
        with model.disable_adapter():
            expected["base"] = model.generate(ids, max_new_tokens=NUM_NEW_TOKENS, do_sample=False)[0, ids.shape[1]:].tolist()
    return expected
