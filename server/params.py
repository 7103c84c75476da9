"""From the wire's `parameters` to the engine's `SamplingParams` and adapter reference.

Range checks live in `SamplingParams` and limits in the engine; this module checks only what is the
service's business (this server's cap, what a stream cannot do, spellings, the schema forms) and refuses, by name, what the
engine cannot do yet instead of silently ignoring it.
"""
from __future__ import annotations

import dataclasses
import json
from typing import Any

from lora_runtime.adapters.merge import MergedAdapters
from lora_runtime.adapters.refs import AdapterRef, AdapterRequest, Caller, parse_adapter_ref
from lora_runtime.adapters.sources.ids import infer_source
from lora_runtime.core import SamplingParams
from lora_runtime.errors import ValidationError
from lora_runtime.sampling.schema import schema_from_response_format
from server.config import ServerConfig
from server.protocol import GenerateParameters
from server.protocol import MergedAdapters as WireMergedAdapters

_SAMPLING_FIELDS = frozenset(field.name for field in dataclasses.fields(SamplingParams))

# Wire fields copied to SamplingParams under the same name when sent (None means "use the default").
_DIRECT_FIELDS = ("max_new_tokens", "do_sample", "temperature", "top_k", "top_p", "typical_p", "seed",
                  "ignore_eos_token", "best_of", "details", "decoder_input_details",
                  "return_full_text", "truncate", "watermark", "apply_chat_template")


def to_sampling_params(
    parameters: GenerateParameters | None, config: ServerConfig, is_stream: bool
) -> SamplingParams:
    """Build the engine's parameters; raises `ValidationError` naming the field on refusal."""
    parameters = parameters or GenerateParameters()
    values: dict[str, Any] = {}
    for name in _DIRECT_FIELDS:
        value = getattr(parameters, name)
        if value is not None:
            values[name] = value
    penalty = _repetition_penalty(parameters)
    if penalty is not None:
        values["repetition_penalty"] = penalty
    if parameters.stop:
        values["stop"] = tuple(parameters.stop)
    schema = schema_text(parameters)
    if schema is not None:
        values["schema"] = schema
    _check_service_limits(values, config, is_stream)
    _refuse_unsupported(values)
    return SamplingParams(**values)


def _repetition_penalty(parameters: GenerateParameters) -> float | None:
    if parameters.repetition_penalty is not None:
        return parameters.repetition_penalty
    return parameters.repitition_penalty


def schema_text(parameters: GenerateParameters) -> str | None:
    """The JSON schema as a string, from `schema` (string or object) or LoRAX's `response_format`."""
    if parameters.schema_ is not None and parameters.response_format is not None:
        raise ValidationError("schema", "send either schema or response_format, not both")
    if parameters.response_format is not None:
        return schema_from_response_format(parameters.response_format.model_dump(by_alias=True))
    schema = parameters.schema_
    return schema if schema is None or isinstance(schema, str) else json.dumps(schema)


def _check_service_limits(values: dict[str, Any], config: ServerConfig, is_stream: bool) -> None:
    # The engine checks the stop-sequence and best_of limits; what a stream cannot do is ours.
    best_of = values.get("best_of", 1)
    if is_stream and isinstance(best_of, int) and best_of > 1:
        raise ValidationError("best_of", "best_of > 1 is not supported when streaming")
    if is_stream and values.get("decoder_input_details"):
        raise ValidationError("decoder_input_details", "not supported when streaming")
    limit = config.max_new_tokens_limit
    if limit is not None and values.get("max_new_tokens", 0) > limit:
        raise ValidationError("max_new_tokens", f"must be <= {limit} on this server")


def _refuse_unsupported(values: dict[str, Any]) -> None:
    """Refuse, by name, a parameter the engine has no field for yet (turned on, not just sent)."""
    for name in list(values):
        if name in _SAMPLING_FIELDS:
            continue
        if values[name] in (False, None):
            del values[name]
            continue
        raise ValidationError(name, "not supported by this engine yet")


def adapter_reference(parameters: GenerateParameters | None, tenant: str) -> AdapterRequest | None:
    """The adapter the request asks for, as the engine's `add_request(adapter=...)` takes it.

    The single place where the wire's adapter fields become the engine's adapter argument (docs/api.md
    section 3): None for the base model; otherwise an `AdapterRequest` scoped to the caller's
    `tenant`, so `pbase` ids resolve in that tenant only. The hub token travels only with requests
    that may reach the hub. Raises `ValidationError` naming the field.
    """
    if parameters is None:
        return None
    merged = parameters.merged_adapters
    if merged is not None and parameters.adapter_id:
        raise ValidationError("merged_adapters", "send either adapter_id or merged_adapters, not both")
    if merged is not None:
        return AdapterRequest(_merged_adapters(merged), Caller(tenant, parameters.api_token))
    if not parameters.adapter_id:
        return None
    ref = _parse_ref(parameters.adapter_id, parameters.adapter_source)
    return AdapterRequest(ref, Caller(tenant, parameters.api_token if ref.source == "hub" else None))


def _parse_ref(adapter_id: str, adapter_source: str | None) -> AdapterRef:
    # `local` only when asked for by name: the engine's local source refuses it unless the operator
    # configured an adapter directory.
    return parse_adapter_ref(adapter_id, adapter_source or None, allow_local=adapter_source == "local")


def _merged_adapters(merged: WireMergedAdapters) -> MergedAdapters:
    for adapter_id in merged.ids:
        try:
            _parse_ref(adapter_id, None)
        except ValidationError as error:
            raise ValidationError("merged_adapters.ids", error.message) from None
    described = {"merge_strategy": merged.merge_strategy, "density": merged.density,
                 "majority_sign_method": merged.majority_sign_method}
    return MergedAdapters(ids=tuple(merged.ids),
                          weights=None if merged.weights is None else tuple(merged.weights),
                          **{name: value for name, value in described.items() if value is not None})


def adapter_headers(parameters: GenerateParameters | None) -> dict[str, str]:
    """`x-adapter-id` and `x-adapter-source` for the adapter a request names (docs/api.md sections 3 and 5)."""
    if parameters is not None and parameters.merged_adapters is not None:
        return {"x-adapter-id": ",".join(parameters.merged_adapters.ids), "x-adapter-source": "merged"}
    if parameters is None or not parameters.adapter_id:
        return {"x-adapter-id": "", "x-adapter-source": "base"}
    return {"x-adapter-id": parameters.adapter_id,
            "x-adapter-source": parameters.adapter_source or infer_source(parameters.adapter_id)}
