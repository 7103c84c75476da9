"""Cold-load latency of one PEFT adapter through each adapter source: `local`, `pbase`, `hub`, `s3`.

A try is one `AdapterLoader.load` of the adapter, the engine's own path from a parsed request to
weights in host memory, with every cache empty: each try gets a new download store in a new
directory, so the source fetches every file again. It is split into `fetch` (the source's
`resolve`: id to a local directory) and `parse` (the rest: reading and checking the safetensors
against the base model). The sources are the real ones, all on loopback:

- local: `LocalSource` on the directory itself (no fetch, only the check that it is an adapter);
- pbase: this server's registry (SQLite records opened as the server opens them, blobs in a local
  directory), the adapter uploaded once through `AdapterRegistry.create_version`, validated with
  the engine's loader as the server validates uploads;
- hub: `huggingface_hub` against the hub-protocol server of `benchmarks.loopback_hub`, a private
  repo read with its reader's token (the access check the hub source makes on every resolve);
- s3: boto3 against the process's moto S3 server of `benchmarks.loopback_s3`, with credentials
  from the environment as the server reads them.

The loopback servers are the test fixtures' (importing `tests.fixtures` works from the repository
root, where the benchmarks run). Sources are tried in turn within each repeat, so machine noise
spreads over all of them; the first repeat also pays one-time costs of the process (lazy imports,
first connections), which is why the median is the figure to quote.
"""
from __future__ import annotations

import contextlib
import hashlib
import statistics
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from lora_runtime.adapters.loader import AdapterLoader
from lora_runtime.adapters.peft_format import load_peft_adapter
from lora_runtime.adapters.refs import (
    AdapterRef,
    AdapterRequest,
    AdapterSource,
    Caller,
    LocalSource,
    parse_adapter_ref,
)
from lora_runtime.adapter_files import ADAPTER_FILES
from lora_runtime.adapters.sources.download import AdapterStore
from lora_runtime.adapters.sources.hub import HubConfig, HubSource
from lora_runtime.adapters.sources.s3 import S3Config, S3Source
from lora_runtime.adapters.weights import LoraWeights
from lora_runtime.engine_info import AdapterLimits, BaseModelShape
from server.db import open_database
from server.registry.blobs import LocalBlobStore
from server.registry.models import RegistryBase
from server.registry.service import AdapterRegistry
from server.registry.source import PbaseResolver
from benchmarks.loopback_hub import HubRepo, HubServer
from benchmarks.loopback_s3 import REGION, s3_server

SOURCES = ("local", "pbase", "hub", "s3")
_TENANT = "bench"
_HUB_TOKEN = "hf_bench_reader"


@dataclass(frozen=True)
class _Served:
    """One source holding the adapter: the id and caller a request names it with, and how to build
    the source around a given (empty) download store."""

    adapter_id: str
    make_source: Callable[[AdapterStore], AdapterSource]
    caller: Caller = field(default_factory=Caller)
    version_key: str = ""


class _TimedSource:
    """Wraps a source to time its `resolve` inside `AdapterLoader.load`: the fetch part of a try."""

    def __init__(self, source: AdapterSource) -> None:
        self.source = source
        self.fetch_s = 0.0

    def resolve(self, ref: AdapterRef, caller: Caller) -> Path:
        start = time.perf_counter()
        try:
            return self.source.resolve(ref, caller)
        finally:
            self.fetch_s = time.perf_counter() - start


def cold_load_latencies(adapter_dir: Path, base_shape: BaseModelShape, limits: AdapterLimits,
                        repeats: int = 3) -> dict[str, dict]:
    """Per source: `median_s`, `min_s` and `tries` (seconds per cold load), `fetch_median_s` and
    `parse_median_s` (its two parts), `bytes` (the adapter files served) and `weights_sha256` (of
    the weights the last try loaded: equal for every source when they all serve the same adapter)."""
    adapter_dir = Path(adapter_dir).resolve()
    files = {p.name: p.read_bytes() for p in sorted(adapter_dir.iterdir()) if p.name in ADAPTER_FILES}
    tries: dict[str, list[tuple[float, float]]] = {name: [] for name in SOURCES}
    digests: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="adapter-sources-") as scratch, contextlib.ExitStack() as stack:
        root = Path(scratch)
        served = {
            "local": _Served(str(adapter_dir), lambda store: LocalSource()),
            "pbase": stack.enter_context(_pbase(files, root / "registry", base_shape, limits)),
            "hub": stack.enter_context(_hub(files)),
            "s3": stack.enter_context(_s3(files)),
        }
        for attempt in range(repeats):
            for name in SOURCES:
                with tempfile.TemporaryDirectory(dir=root) as store_dir:
                    source = _TimedSource(served[name].make_source(AdapterStore(Path(store_dir))))
                    loader = AdapterLoader(base_shape, limits, {name: source}, allow_local_paths=True)
                    ref = parse_adapter_ref(served[name].adapter_id, adapter_source=name, allow_local=True)
                    request = AdapterRequest(ref, served[name].caller, served[name].version_key)
                    start = time.perf_counter()
                    loaded = loader.load(request)
                    total_s = time.perf_counter() - start
                tries[name].append((total_s, source.fetch_s))
                if attempt == repeats - 1:
                    digests[name] = weights_sha256(loaded.weights)
    return {
        name: {
            "median_s": statistics.median(total for total, _ in tries[name]),
            "min_s": min(total for total, _ in tries[name]),
            "tries": [total for total, _ in tries[name]],
            "fetch_median_s": statistics.median(fetch for _, fetch in tries[name]),
            "parse_median_s": statistics.median(total - fetch for total, fetch in tries[name]),
            "bytes": sum(len(data) for data in files.values()),
            "weights_sha256": digests[name],
        }
        for name in SOURCES
    }


def weights_sha256(weights: LoraWeights) -> str:
    """A digest of what was loaded: module keys, scales and the factors' bytes."""
    digest = hashlib.sha256()
    for (layer, module), factors in weights.modules.items():
        digest.update(f"{layer}.{module}:{factors.scale!r}".encode())
        for tensor in (factors.lora_a, factors.lora_b):
            digest.update(tensor.contiguous().view(torch.uint8).numpy())
    return digest.hexdigest()


@contextlib.contextmanager
def _pbase(files: dict[str, bytes], root: Path, base_shape: BaseModelShape,
           limits: AdapterLimits) -> Iterator[_Served]:
    root.mkdir()
    database = open_database(f"sqlite:///{root / 'registry.db'}", [RegistryBase.metadata])
    try:
        # Uploads are validated as the server validates them: by the engine's own adapter reader.
        registry = AdapterRegistry(database.sessions, LocalBlobStore(root / "blobs"),
                                   lambda directory: load_peft_adapter(directory, base_shape, limits))
        upload = root / "upload"
        upload.mkdir()
        for name, data in files.items():
            (upload / name).write_bytes(data)
        version = registry.create_version(_TENANT, "bench", "adapter", upload)
        yield _Served(f"adapter/{version.tag}",
                      lambda store: PbaseResolver(registry.sessions, registry.blobs, store),
                      Caller(scope=_TENANT), version_key=version.blob_id)
    finally:
        database.dispose()


@contextlib.contextmanager
def _hub(files: dict[str, bytes]) -> Iterator[_Served]:
    hub = HubServer()
    hub.repos["bench/adapter"] = HubRepo("private", readers=frozenset({_HUB_TOKEN}))
    hub.repos["bench/adapter"].add_commit(files)
    hub.start()
    try:
        yield _Served("bench/adapter", lambda store: HubSource(HubConfig(hub.endpoint), store),
                      Caller(api_token=_HUB_TOKEN))
    finally:
        hub.stop()


@contextlib.contextmanager
def _s3(files: dict[str, bytes]) -> Iterator[_Served]:
    # moto's server is one per process (its authentication switch and its buckets are process-wide),
    # so it is shared with the tests and left running; this bucket is ours alone and removed after.
    s3 = s3_server()
    bucket = f"bench-{uuid.uuid4().hex[:12]}"
    client = s3.client()
    client.create_bucket(Bucket=bucket)
    try:
        for name, data in files.items():
            client.put_object(Bucket=bucket, Key=f"adapter/{name}", Body=data)
        with pytest.MonkeyPatch.context() as env:
            s3.use_credentials(env)  # boto3 reads the credential chain when each source's client is made
            config = S3Config(endpoint_url=s3.endpoint_url, region=REGION, path_style=True)
            yield _Served(f"s3://{bucket}/adapter", lambda store: S3Source(config, store))
    finally:
        for name in files:
            client.delete_object(Bucket=bucket, Key=f"adapter/{name}")
        client.delete_bucket(Bucket=bucket)
