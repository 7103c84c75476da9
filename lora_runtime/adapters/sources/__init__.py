"""Where adapter files come from. Each source turns an adapter id into a local directory:
`resolve(ref, caller) -> Path` (the `AdapterSource` protocol of `refs.py`) (hub.HubSource, s3.S3Source; the `pbase` source lives in
`server.registry.source` because the registry is the server's). All share one download.AdapterStore.
Modules are imported directly (`from lora_runtime.adapters.sources.hub import HubSource`) so that
using one source does not import the others' client libraries."""
