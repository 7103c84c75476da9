"""From the wire's `parameters` to the engine's `SamplingParams` and adapter reference.

Range checks live in `SamplingParams` and limits in the engine; this module checks only what is the
service's business (this server's cap, what a stream cannot do, spellings, the schema forms) and refuses, by name, what the
engine cannot do yet instead of silently ignoring it.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

from lora_runtime.api import (MAX_TOP_LOGPROBS, AdapterRef, AdapterRequest, Caller, MergedAdapters, SamplingParams,
                              ValidationError, check_remote, infer_source, merged_id_ref, parse_adapter_ref,
                              schema_from_response_format)
from server.config import ServerConfig
from server.errors import model_not_found
from server.protocol import GenerateParameters
from server.protocol import MergedAdapters as WireMergedAdapters
from server.responses import TopCounts
from server.tenancy import Deployment

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
    if parameters.frequency_penalty is not None:
        values["frequency_penalty"] = parameters.frequency_penalty
        values["penalty_counts"] = "sequence_fraction"  # TGI's definition (docs/semantics.md)
    if parameters.stop:
        values["stop"] = tuple(parameters.stop)
    values.update(_constraint(parameters))
    counts = top_counts(parameters)
    if max(counts.top_n_tokens, counts.alternatives):
        values["top_logprobs"] = max(counts.top_n_tokens, counts.alternatives)
    if values.get("best_of", 1) > 1 and values.get("seed") is not None:
        # TGI's rule, which its and LoRAX's clients check before sending; the engine itself would
        # give candidate i the seed + i (the OpenAI routes' `n` does).
        raise ValidationError("seed", "must not be set when best_of > 1")
    check_service_limits(values, config, is_stream)
    _refuse_unsupported(values)
    return SamplingParams(**values)


def _repetition_penalty(parameters: GenerateParameters) -> float | None:
    if parameters.repetition_penalty is not None:
        return parameters.repetition_penalty
    return parameters.repitition_penalty


def top_counts(parameters: GenerateParameters | None) -> TopCounts:
    """How many most likely tokens `top_n_tokens` and `return_k_alternatives` ask for (0: none)."""
    if parameters is None:
        return TopCounts()
    for name in ("top_n_tokens", "return_k_alternatives"):
        value = getattr(parameters, name)
        if value is not None and not 0 <= value <= MAX_TOP_LOGPROBS:
            raise ValidationError(name, f"must be in [0, {MAX_TOP_LOGPROBS}]")
    return TopCounts(top_n_tokens=parameters.top_n_tokens or 0,
                     alternatives=parameters.return_k_alternatives or 0)


def _constraint(parameters: GenerateParameters) -> dict[str, str]:
    """`schema` or `regex` for the engine, from whichever of `schema`, LoRAX's `response_format`
    and TGI's `grammar` was sent (at most one)."""
    sent = [name for name in ("schema_", "response_format", "grammar") if getattr(parameters, name) is not None]
    if len(sent) > 1:
        names = " and ".join(name.rstrip("_") for name in sent)
        raise ValidationError(sent[0].rstrip("_"), f"send only one of schema, response_format and grammar (got {names})")
    if parameters.response_format is not None:
        return {"schema": schema_from_response_format(parameters.response_format.model_dump(by_alias=True))}
    grammar = parameters.grammar
    if grammar is not None and grammar.type == "regex":
        if not isinstance(grammar.value, str) or not grammar.value:
            raise ValidationError("grammar.value", "a regex grammar needs a non-empty string")
        return {"regex": grammar.value}
    schema = grammar.value if grammar is not None else parameters.schema_
    if schema is None:
        return {}
    return {"schema": schema if isinstance(schema, str) else json.dumps(schema)}


def check_service_limits(values: dict[str, Any], config: ServerConfig, is_stream: bool) -> None:
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


@dataclass(frozen=True, slots=True)
class AdapterScope:
    """Where a request's adapter ids are read: for `tenant` (its registry holds the `pbase` ids), on
    `deployment` (whose base model an id that names no adapter is told about), by a server that
    serves hub ids only when `hub_enabled`."""

    tenant: str
    deployment: Deployment
    hub_enabled: bool

    @property
    def models_path(self) -> str:
        """The route that lists the adapters this tenant can name on this deployment."""
        return f"/{self.tenant}/deployments/v2/llms/{self.deployment.name}/v1/models"


def adapter_scope(tenant: str, deployment: Deployment, config: ServerConfig) -> AdapterScope:
    return AdapterScope(tenant, deployment, hub_enabled=config.hub_endpoint is not None)


def adapter_reference(parameters: GenerateParameters | None, scope: AdapterScope) -> AdapterRequest | None:
    """The adapter the request asks for, as the engine's `add_request(adapter=...)` takes it.

    The single place where the wire's adapter fields become the engine's adapter argument (docs/api.md
    section 3): None for the base model; otherwise an `AdapterRequest` scoped to the caller's
    tenant, so `pbase` ids resolve in that tenant only. The hub token travels only with requests
    that may reach the hub. Raises `ValidationError` naming the field, or `ApiError` 404
    `model_not_found` for an id that no source of this server could serve.
    """
    if parameters is None:
        return None
    merged = parameters.merged_adapters
    if merged is not None and parameters.adapter_id:
        raise ValidationError("merged_adapters", "send either adapter_id or merged_adapters, not both")
    if merged is not None:
        return _merged_adapters(merged, scope, Caller(scope.tenant, parameters.api_token))
    if not parameters.adapter_id:
        return None
    ref = _servable_ref(parameters.adapter_id, parameters.adapter_source, scope, "adapter_id")
    return AdapterRequest(ref, Caller(scope.tenant, parameters.api_token if ref.source == "hub" else None))


def _servable_ref(adapter_id: str, adapter_source: str | None, scope: AdapterScope, field: str) -> AdapterRef:
    """The id parsed, its source inferred once (when the request names none). An id inferred as
    `hub` on a server that serves no hub adapters can be no adapter at all (`pbase` and `s3` ids have
    their own forms; `local` is only ever asked for by name): most often a model name typed out of
    habit (`llama-3-8b`), told so rather than 424 from a hub that is not there. An explicit
    `adapter_source` is the source's to answer."""
    source = adapter_source or infer_source(adapter_id)
    if not adapter_source and source == "hub" and not scope.hub_enabled:
        # A malformed id (a way out, too long, control characters) is refused as such, and never quoted.
        check_remote(adapter_id)
        raise model_not_found(field, adapter_id, scope.deployment.base_model, scope.models_path)
    # `local` only when asked for by name: the engine's local source refuses it unless the operator
    # configured an adapter directory.
    return parse_adapter_ref(adapter_id, source, allow_local=adapter_source == "local")


def _merged_adapters(merged: WireMergedAdapters, scope: AdapterScope, caller: Caller) -> AdapterRequest:
    described = {"merge_strategy": merged.merge_strategy, "density": merged.density,
                 "majority_sign_method": merged.majority_sign_method}
    # Its bounds first: a merge past them is refused before any of its ids is looked at.
    spec = MergedAdapters(ids=tuple(merged.ids),
                          weights=None if merged.weights is None else tuple(merged.weights),
                          **{name: value for name, value in described.items() if value is not None})
    parts = tuple(merged_id_ref(lambda: _servable_ref(adapter_id, None, scope, "merged_adapters.ids"))
                  for adapter_id in spec.distinct_ids)
    return AdapterRequest(spec, caller, parts=parts)


def adapter_headers(adapter: AdapterRequest | None) -> dict[str, str]:
    """`x-adapter-id` and `x-adapter-source` for the adapter a request names (docs/api.md sections 3
    and 5), read from `adapter_reference`'s answer: the source as parsed there, not inferred again."""
    if adapter is None:
        return {"x-adapter-id": "", "x-adapter-source": "base"}
    if isinstance(adapter.adapter, MergedAdapters):
        return {"x-adapter-id": ",".join(adapter.adapter.ids), "x-adapter-source": "merged"}
    return {"x-adapter-id": adapter.adapter.adapter_id, "x-adapter-source": adapter.adapter.source}
