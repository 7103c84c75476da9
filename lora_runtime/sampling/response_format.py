"""The wire's structured-output options, torch-free: a request's `response_format` read as a JSON
schema, and the options every schema compiles with (`lora_runtime.sampling.schema` compiles them for
the sampler; the OpenAI routes check tool schemas with the same options)."""
from __future__ import annotations

import json
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from lora_runtime.errors import ValidationError

if TYPE_CHECKING:
    import llguidance

# Compact separators with one space, no free whitespace: small models otherwise emit runs of
# newlines inside documents and never close them. A schema's own "x-guidance" options override these.
JSON_COMPILE_OPTIONS: llguidance.JsonCompileOptions = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}


def schema_from_response_format(response_format: Mapping[str, Any] | None) -> str | None:
    """LoRAX's `response_format` {type: "json_object" | "json_schema", schema} as a schema string.

    OpenAI's nesting {type: "json_schema", json_schema: {name, schema}} is accepted too;
    `json_object` without a schema constrains the output to any JSON object.
    """
    if response_format is None:
        return None
    kind = response_format.get("type")
    if kind not in ("json_object", "json_schema"):
        raise ValidationError("response_format", "type must be 'json_object' or 'json_schema'")
    schema = response_format.get("schema")
    nested = response_format.get("json_schema")
    if schema is None and isinstance(nested, Mapping):
        schema = nested.get("schema")
    if schema is None:
        if kind == "json_schema":
            raise ValidationError("response_format", "type 'json_schema' needs a schema")
        schema = {"type": "object"}
    return schema if isinstance(schema, str) else json.dumps(schema)
