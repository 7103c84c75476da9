"""From the wire's `parameters` to the engine's `SamplingParams` and adapter reference.

Range checks live in `SamplingParams` and limits in the engine; this module checks only what is the
service's business (this server's cap, what a stream cannot do, spellings, the schema forms) and refuses, by name, what the
engine cannot do yet instead of silently ignoring it.
"""
from __future__ import annotations

import dataclasses
import json
import re
from typing import Any

from lora_runtime.core import SamplingParams
from lora_runtime.errors import ValidationError
from lora_runtime.sampling.schema import schema_from_response_format
from server.config import ServerConfig
from server.protocol import GenerateParameters

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


def adapter_reference(parameters: GenerateParameters | None) -> None:
    """The adapter the request asks for, in the form the engine's `add_request(adapter=...)` takes.

    The single place where adapter fields become the engine's adapter argument. No adapter support
    in the engine yet: a request naming one is refused; none named means the base model (None).
    """
    if parameters is None:
        return None
    if parameters.merged_adapters is not None:
        raise ValidationError("merged_adapters", "adapters are not supported by this engine yet")
    if parameters.adapter_id:
        raise ValidationError("adapter_id", "adapters are not supported by this engine yet")
    return None


_PBASE_ID = re.compile(r"^[^/]+/\d+(@\d+)?$")


def adapter_headers(parameters: GenerateParameters | None) -> dict[str, str]:
    """`x-adapter-id` and `x-adapter-source` for the adapter a request names (API.md 3 and 5)."""
    if parameters is not None and parameters.merged_adapters is not None:
        return {"x-adapter-id": ",".join(parameters.merged_adapters.ids), "x-adapter-source": "merged"}
    if parameters is None or not parameters.adapter_id:
        return {"x-adapter-id": "", "x-adapter-source": "base"}
    return {"x-adapter-id": parameters.adapter_id,
            "x-adapter-source": parameters.adapter_source or _inferred_source(parameters.adapter_id)}


def _inferred_source(adapter_id: str) -> str:
    if adapter_id.startswith("s3://"):
        return "s3"
    return "pbase" if _PBASE_ID.match(adapter_id) else "hub"
