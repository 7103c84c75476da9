"""Wire parameters to SamplingParams: nulls, spellings, schema forms, service limits, refusals."""
from __future__ import annotations

import json

import pytest

from lora_runtime.core import SamplingParams
from lora_runtime.errors import ValidationError
from server.config import ServerConfig
from lora_runtime.adapters import AdapterRef, AdapterRequest, Caller, MergedAdapters
from server.errors import ApiError
from server.params import AdapterScope, adapter_headers, adapter_reference, to_sampling_params
from server.protocol import GenerateParameters
from server.tenancy import Deployment

CONFIG = ServerConfig()


def params(body: dict, is_stream: bool = False) -> SamplingParams:
    return to_sampling_params(GenerateParameters.model_validate(body), CONFIG, is_stream)


def test_explicit_nulls_give_the_defaults() -> None:
    # What lorax-client 0.6.3 sends for a bare generate call.
    body = {"adapter_id": None, "adapter_source": None, "merged_adapters": None, "api_token": None,
            "do_sample": False, "max_new_tokens": None, "ignore_eos_token": False,
            "repetition_penalty": None, "return_full_text": False, "stop": [], "seed": None,
            "temperature": None, "top_k": None, "top_p": None, "truncate": None, "typical_p": None,
            "best_of": None, "watermark": False, "details": True, "decoder_input_details": False,
            "return_k_alternatives": None, "response_format": None}
    assert params(body) == SamplingParams(details=True)


def test_every_spec_parameter_reaches_sampling_params() -> None:
    body = {"best_of": 2, "details": True, "decoder_input_details": True, "do_sample": True,
            "max_new_tokens": 7, "repetition_penalty": 1.3, "return_full_text": True,
            "stop": ["x"], "temperature": 0.7, "top_k": 9, "top_p": 0.9, "truncate": 11,
            "typical_p": 0.8, "watermark": True, "ignore_eos_token": True, "schema": '{"type":"object"}'}
    expected = SamplingParams(best_of=2, details=True, decoder_input_details=True, do_sample=True,
                              max_new_tokens=7, repetition_penalty=1.3, return_full_text=True,
                              stop=("x",), temperature=0.7, top_k=9, top_p=0.9, truncate=11,
                              typical_p=0.8, watermark=True, ignore_eos_token=True,
                              schema='{"type":"object"}')
    assert params(body) == expected
    assert params({"seed": 5, "do_sample": True}).seed == 5  # seed goes with best_of 1 only


def test_tgi_parameters_reach_the_engine_with_tgis_semantics() -> None:
    penalised = params({"frequency_penalty": 0.5})
    assert (penalised.frequency_penalty, penalised.penalty_counts) == (0.5, "sequence_fraction")
    assert params({"top_n_tokens": 3, "return_k_alternatives": 5}).top_logprobs == 5
    assert params({"top_n_tokens": 0}).top_logprobs == 0
    assert params({"grammar": {"type": "regex", "value": "[0-9]+"}}).regex == "[0-9]+"
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    assert json.loads(params({"grammar": {"type": "json", "value": schema}}).schema) == schema
    assert params({"grammar": {"type": "json", "value": json.dumps(schema)}}).schema == json.dumps(schema)


def test_both_penalty_spellings_and_the_correct_one_wins() -> None:
    assert params({"repitition_penalty": 1.5}).repetition_penalty == 1.5
    assert params({"repitition_penalty": 1.5, "repetition_penalty": 1.2}).repetition_penalty == 1.2


@pytest.mark.parametrize("body", [
    {"schema": {"type": "object", "properties": {"a": {"type": "integer"}}}},
    {"response_format": {"type": "json_object", "schema": {"type": "object", "properties": {"a": {"type": "integer"}}}}},
    {"response_format": {"type": "json_schema", "schema": '{"type": "object", "properties": {"a": {"type": "integer"}}}'}},
])
def test_schema_forms_become_one_json_string(body: dict) -> None:
    assert json.loads(params(body).schema) == {"type": "object", "properties": {"a": {"type": "integer"}}}


@pytest.mark.parametrize(("body", "is_stream", "field"), [
    ({"best_of": 2, "do_sample": True}, True, "best_of"),
    ({"decoder_input_details": True}, True, "decoder_input_details"),
    ({"best_of": 2}, False, "best_of"),
    ({"best_of": 2, "do_sample": True, "seed": 3}, False, "seed"),
    ({"temperature": -0.5}, False, "temperature"),
    ({"top_p": 1.5}, False, "top_p"),
    ({"schema": "{}", "response_format": {"type": "json_object"}}, False, "schema"),
    ({"response_format": {"type": "json_schema"}}, False, "response_format"),
    ({"grammar": {"type": "regex", "value": "a"}, "schema": "{}"}, False, "schema"),
    ({"grammar": {"type": "regex", "value": ""}}, False, "grammar.value"),
    ({"top_n_tokens": -1}, False, "top_n_tokens"),
    ({"return_k_alternatives": 21}, False, "return_k_alternatives"),
    ({"frequency_penalty": 2.5}, False, "frequency_penalty"),
])
def test_refusals_name_the_field(body: dict, is_stream: bool, field: str) -> None:
    with pytest.raises(ValidationError) as refused:
        params(body, is_stream)
    assert refused.value.field == field


def test_a_parameter_the_engine_lacks_is_refused_by_name_not_ignored() -> None:
    if "apply_chat_template" in SamplingParams.__dataclass_fields__:
        assert params({"apply_chat_template": True}).apply_chat_template is True
    else:
        with pytest.raises(ValidationError, match="apply_chat_template"):
            params({"apply_chat_template": True})
    assert params({"apply_chat_template": False}) == SamplingParams()


DEPLOYMENT = Deployment("acme-support", "acme", "smollm2-135m-instruct")


def _adapter(body: dict, tenant: str = "acme", hub_enabled: bool = True):
    return adapter_reference(GenerateParameters.model_validate(body), AdapterScope(tenant, DEPLOYMENT, hub_enabled))


def test_adapter_fields_become_a_tenant_scoped_adapter_request() -> None:
    assert _adapter({"adapter_id": ""}) is None and _adapter({}) is None
    pbase = _adapter({"adapter_id": "repo/1@3", "api_token": "hf_x"})
    assert pbase == AdapterRequest(AdapterRef("pbase", "repo/1@3", "repo", 1, "3"), Caller("acme"))
    hub = _adapter({"adapter_id": "org/name@v2", "api_token": "hf_x"}, tenant="other")
    assert hub == AdapterRequest(AdapterRef("hub", "org/name@v2", "org/name", revision="v2"), Caller("other", "hf_x"))
    s3 = _adapter({"adapter_id": "bucket/prefix", "adapter_source": "s3"})
    assert s3.adapter == AdapterRef("s3", "bucket/prefix", "bucket/prefix") and s3.caller.api_token is None
    assert _adapter({"adapter_id": "team/a", "adapter_source": "local"}).adapter.source == "local"
    merged = _adapter({"merged_adapters": {"ids": ["a/1", "org/b"], "weights": [0.5, 2],
                                           "merge_strategy": "ties", "density": 0.5}})
    assert merged.adapter == MergedAdapters(("a/1", "org/b"), (0.5, 2.0), "ties", 0.5, "total")
    # The merge's ids are parsed here, once, into the parts the loader and the registry read.
    assert merged.parts == (AdapterRef("pbase", "a/1", "a", 1), AdapterRef("hub", "org/b", "org/b"))
    assert pbase.key != _adapter({"adapter_id": "repo/1@3"}, tenant="other").key


@pytest.mark.parametrize(("body", "field"), [
    ({"adapter_id": "repo/1", "merged_adapters": {"ids": ["a/1"]}}, "merged_adapters"),
    ({"adapter_id": "../x"}, "adapter_id"),
    ({"adapter_id": "repo/1", "adapter_source": "ftp"}, "adapter_source"),
    ({"merged_adapters": {"ids": []}}, "merged_adapters.ids"),
    ({"merged_adapters": {"ids": ["a/1", "/etc"]}}, "merged_adapters.ids"),
    ({"merged_adapters": {"ids": ["a/1", "b/1"], "weights": [1.0]}}, "merged_adapters.weights"),
    ({"merged_adapters": {"ids": ["a/1"], "merge_strategy": "svd"}}, "merged_adapters.merge_strategy"),
    ({"merged_adapters": {"ids": ["a/1"], "density": 0}}, "merged_adapters.density"),
    ({"merged_adapters": {"ids": ["a/1"], "majority_sign_method": "max"}}, "merged_adapters.majority_sign_method"),
])
def test_bad_adapter_fields_are_refused_naming_the_field(body: dict, field: str) -> None:
    with pytest.raises(ValidationError) as refused:
        _adapter(body)
    assert refused.value.field == field


@pytest.mark.parametrize(("body", "adapter_id", "source"), [
    ({}, "", "base"),
    ({"adapter_id": ""}, "", "base"),
    ({"adapter_id": "support/3"}, "support/3", "pbase"),
    ({"adapter_id": "support/3@12"}, "support/3@12", "pbase"),
    ({"adapter_id": "org/name"}, "org/name", "hub"),
    ({"adapter_id": "s3://bucket/prefix"}, "s3://bucket/prefix", "s3"),
    ({"adapter_id": "bucket/prefix", "adapter_source": "s3"}, "bucket/prefix", "s3"),
    ({"merged_adapters": {"ids": ["a/1", "b/2"]}}, "a/1,b/2", "merged"),
])
def test_adapter_headers_name_the_adapter_and_its_source(body: dict, adapter_id: str, source: str) -> None:
    headers = adapter_headers(_adapter(body))
    assert headers == {"x-adapter-id": adapter_id, "x-adapter-source": source}


@pytest.mark.parametrize(("body", "field", "model"), [
    ({"adapter_id": "llama-3-8b"}, "adapter_id", "llama-3-8b"),
    ({"adapter_id": "meta-llama/Meta-Llama-3-8B-Instruct"}, "adapter_id", "meta-llama/Meta-Llama-3-8B-Instruct"),
    ({"adapter_id": "gpt-4o mini"}, "adapter_id", "gpt-4o mini"),  # no hub id either: still no model
    ({"merged_adapters": {"ids": ["a/1", "llama-3-8b"]}}, "merged_adapters.ids", "llama-3-8b"),
])
def test_an_id_no_enabled_source_serves_is_404_model_not_found(body: dict, field: str, model: str) -> None:
    """Without a hub, an id inferred as a hub id can be no adapter: it names no model here."""
    with pytest.raises(ApiError) as refused:
        _adapter(body, hub_enabled=False)
    error = refused.value
    assert (error.status_code, error.error_type, error.param) == (404, "model_not_found", field)
    assert error.message.startswith(f"{field}: {model!r} ")
    assert repr(DEPLOYMENT.base_model) in error.message
    assert "GET /acme/deployments/v2/llms/acme-support/v1/models" in error.message


def test_ids_an_enabled_source_may_serve_are_left_to_it() -> None:
    assert _adapter({"adapter_id": "repo/1"}, hub_enabled=False).adapter.source == "pbase"
    assert _adapter({"adapter_id": "s3://bucket/prefix"}, hub_enabled=False).adapter.source == "s3"
    assert _adapter({"adapter_id": "llama-3-8b"}, hub_enabled=True).adapter.source == "hub"
    # Asked for by name, the hub answers for itself (424: not configured).
    assert _adapter({"adapter_id": "org/name", "adapter_source": "hub"}, hub_enabled=False).adapter.source == "hub"
    for malformed in ("x" * 300, "../repo/1", "/etc/passwd"):  # refused as bad ids, never quoted
        with pytest.raises(ValidationError):
            _adapter({"adapter_id": malformed}, hub_enabled=False)
