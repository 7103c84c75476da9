"""OpenAI request bodies to the engine's arguments (docs/api.md section 8).

Each parameter maps onto the engine's existing semantics or is refused by name (400): OpenAI's
defaults (temperature 1, so sampling is on), its additive presence/frequency penalties over the
generated tokens (`penalty_counts="output"`), `n` as candidates of one prompt (`best_of`),
`logit_bias`, `response_format`, `logprobs`/`top_logprobs`, `echo`, tools (`server.openai_api.tools`:
their grammar goes to the engine, the tools to the chat template's input). Errors the engine raises name
its own fields; `wire_name` gives the name the request used.
"""
from __future__ import annotations

import json
from typing import Any

from lora_runtime.api import AdapterRequest, SamplingParams, ValidationError, schema_from_response_format
from server.config import ServerConfig
from server.deployments import Deployment
from server.openai_api.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
)
from server.openai_api.tools import ToolPlan, template_tool_calls
from server.params import AdapterScope, adapter_headers, adapter_reference, check_service_limits
from server.protocol import GenerateParameters

# OpenAI's documented defaults.
_DEFAULT_TEMPERATURE = 1.0
_COMPLETIONS_DEFAULT_MAX_TOKENS = 16
_MAX_TEMPERATURE = 2.0

_CHAT_ROLES = {"system", "user", "assistant", "tool"}
# OpenAI's newer name for the system role; chat templates know only "system".
_ROLE_ALIASES = {"developer": "system"}


# What TGI's own client (text-generation) sends as `model`: TGI serves one model and ignores it.
_TGI_CLIENT_MODEL = "tgi"


def is_tgi_client(body: ChatCompletionRequest | CompletionRequest) -> bool:
    """The request comes from TGI's own client, which reads TGI's stream shapes."""
    return body.model == _TGI_CLIENT_MODEL


def is_base_model(model: str | None, deployment: Deployment) -> bool:
    """`model` names no adapter: empty, the deployment's base model, the deployment itself, or
    TGI's client's placeholder."""
    return not model or model in (deployment.base_model, deployment.name, _TGI_CLIENT_MODEL)


def adapter_for(body: ChatCompletionRequest | CompletionRequest,
                scope: AdapterScope) -> tuple[AdapterRequest | None, dict[str, str]]:
    """The adapter `model` names (None for the base model) and the `x-adapter-*` headers, through
    the same single parser as the TGI routes' `adapter_id`."""
    if is_base_model(body.model, scope.deployment):
        parameters = GenerateParameters()
    else:
        parameters = GenerateParameters(adapter_id=body.model, adapter_source=body.adapter_source,
                                        api_token=body.api_token)
    try:
        adapter = adapter_reference(parameters, scope)
    except ValidationError as error:
        raise ValidationError("model", error.message.removeprefix("adapter_id: ")) from None
    return adapter, adapter_headers(adapter)


def chat_sampling_params(body: ChatCompletionRequest, config: ServerConfig, tools: ToolPlan | None) -> SamplingParams:
    _refuse_chat_extras(body)
    if body.top_logprobs is not None and not body.logprobs:
        raise ValidationError("top_logprobs", "needs logprobs: true")
    values = _common_values(body, config)
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    # Unset: as many tokens as the context leaves (the engine decides, once the prompt is known),
    # within this server's cap.
    values["max_new_tokens"] = max_tokens if max_tokens is not None else config.max_new_tokens_limit
    if body.logprobs:
        values["top_logprobs"] = body.top_logprobs or 0
    if body.response_format is not None and body.response_format.get("type") != "text":
        values["schema"] = _response_format_schema(body.response_format)
    if tools is not None:
        values["tool_calling"] = tools.calling
    values["apply_chat_template"] = True
    return _sampling_params(values, config, bool(body.stream))


def completion_sampling_params(body: CompletionRequest, config: ServerConfig) -> SamplingParams:
    if body.suffix:
        raise ValidationError("suffix", "not supported: the model has no fill-in-the-middle mode")
    values = _common_values(body, config)
    values["max_new_tokens"] = body.max_tokens if body.max_tokens is not None else _COMPLETIONS_DEFAULT_MAX_TOKENS
    if body.best_of is not None:
        if body.best_of < values.get("best_of", 1):
            raise ValidationError("best_of", "must be >= n")
        if body.stream and body.best_of > values.get("best_of", 1):
            raise ValidationError("best_of", "must equal n when streaming (each choice streams as it is drawn)")
        values["best_of"] = body.best_of
    if body.logprobs is not None:
        values["top_logprobs"] = body.logprobs
    if body.echo and body.logprobs is not None:
        # The prompt's logprobs come with it (OpenAI's echo + logprobs).
        values["decoder_input_details"] = True
    return _sampling_params(values, config, bool(body.stream))


def chat_inputs(messages: list[ChatMessage], tools: ToolPlan | None) -> str:
    """The messages as the engine's `apply_chat_template` input: a JSON list of {role, content}
    (with the tool-calling fields), or with tools the object {messages, tools, tool_prompt}."""
    if not messages:
        raise ValidationError("messages", "must not be empty")
    rendered = [_chat_message(message, index) for index, message in enumerate(messages)]
    if tools is None:
        return json.dumps(rendered)
    document = {"messages": rendered, "tools": list(tools.tools)}
    if tools.tool_prompt is not None:
        document["tool_prompt"] = tools.tool_prompt
    return json.dumps(document)


def _chat_message(message: ChatMessage, index: int) -> dict[str, Any]:
    role = _ROLE_ALIASES.get(message.role, message.role)
    if role not in _CHAT_ROLES:
        raise ValidationError(f"messages[{index}].role",
                              f"{message.role!r} is not supported (system, developer, user, assistant, tool)")
    if message.function_call:
        raise ValidationError(f"messages[{index}].function_call", "the deprecated functions API is not supported")
    if message.tool_calls and role != "assistant":
        raise ValidationError(f"messages[{index}].tool_calls", "only assistant messages carry tool calls")
    if role == "tool" and not message.tool_call_id:
        raise ValidationError(f"messages[{index}].tool_call_id", "a tool message needs the id of the call it answers")
    if message.tool_calls:
        # An assistant turn that only called tools has no content.
        text = "" if message.content is None else _message_text(message, index)
        return {"role": role, "content": text,
                "tool_calls": template_tool_calls(message.tool_calls, f"messages[{index}].tool_calls")}
    rendered: dict[str, Any] = {"role": role, "content": _message_text(message, index)}
    if message.tool_call_id:
        rendered["tool_call_id"] = message.tool_call_id
    return rendered


def completion_prompts(prompt: str | list[str] | list[int] | list[list[int]]) -> list[str | list[int]]:
    """The prompts, each text or token ids: one, or a list of several (one choice each per `n`)."""
    prompts = prompt if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)) else [prompt]
    for index, each in enumerate(prompts):
        if not isinstance(each, (str, list)) or not each:
            raise ValidationError("prompt" if len(prompts) == 1 else f"prompt[{index}]", "must not be empty")
    return prompts


def wire_name(field: str, body: ChatCompletionRequest | CompletionRequest) -> str:
    """The request's name for an engine field that an error names."""
    is_chat = isinstance(body, ChatCompletionRequest)
    if field == "max_new_tokens":
        return "max_completion_tokens" if is_chat and body.max_completion_tokens is not None else "max_tokens"
    if field == "best_of":
        return "best_of" if not is_chat and body.best_of is not None else "n"
    names = {"inputs": "messages" if is_chat else "prompt", "apply_chat_template": "messages",
             "schema": "response_format", "lark_grammar": "tools", "tool_calling": "tools", "decoder_input_details": "echo",
             "top_logprobs": "top_logprobs" if is_chat else "logprobs",
             "penalty_counts": "frequency_penalty", "adapter_id": "model"}
    return names.get(field, field)


def _common_values(body: ChatCompletionRequest | CompletionRequest, config: ServerConfig) -> dict[str, Any]:
    temperature = _DEFAULT_TEMPERATURE if body.temperature is None else body.temperature
    if not 0 <= temperature <= _MAX_TEMPERATURE:
        raise ValidationError("temperature", f"must be in [0, {_MAX_TEMPERATURE:g}]")
    n = 1 if body.n is None else body.n
    if n < 1:
        raise ValidationError("n", "must be >= 1")
    if n > 1 and temperature == 0:
        raise ValidationError("n", "n > 1 needs sampling: temperature 0 would give n equal choices")
    values: dict[str, Any] = {"do_sample": temperature > 0, "best_of": n}
    if temperature not in (0, 1):
        values["temperature"] = temperature
    optional = {"top_p": body.top_p, "seed": body.seed, "top_k": body.top_k,
                "repetition_penalty": body.repetition_penalty,
                "frequency_penalty": body.frequency_penalty, "presence_penalty": body.presence_penalty}
    values.update({name: value for name, value in optional.items() if value is not None})
    if body.stop:
        values["stop"] = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop)
    if body.logit_bias:
        values["logit_bias"] = _logit_bias(body.logit_bias)
    return values


def _sampling_params(values: dict[str, Any], config: ServerConfig, is_stream: bool) -> SamplingParams:
    # Streamed, the n choices are n engine requests of one candidate each (server.fan_out).
    check_service_limits({**values, "best_of": 1} if is_stream else values, config, is_stream)
    return SamplingParams(**values)


def _logit_bias(bias: dict[str, float]) -> tuple[tuple[int, float], ...]:
    pairs = []
    for key, value in bias.items():
        if not key.isdigit():
            raise ValidationError("logit_bias", f"keys must be token ids, got {key!r}")
        pairs.append((int(key), value))
    return tuple(pairs)


def _response_format_schema(response_format: dict[str, Any]) -> str:
    try:
        return schema_from_response_format(response_format)
    except ValidationError as error:
        raise ValidationError("response_format", error.message.removeprefix("response_format: ")) from None


def _message_text(message: ChatMessage, index: int) -> str:
    if message.content is None:
        raise ValidationError(f"messages[{index}].content", "must be text")
    if isinstance(message.content, str):
        return message.content
    pieces = []
    for part in message.content:
        if part.type != "text" or part.text is None:
            raise ValidationError(f"messages[{index}].content",
                                  f"content parts of type {part.type!r} are not supported (text only)")
        pieces.append(part.text)
    return "".join(pieces)


def _refuse_chat_extras(body: ChatCompletionRequest) -> None:
    """Known OpenAI parameters this server cannot honour: refused unless sent neutral."""
    if body.modalities not in (None, ["text"]):
        raise ValidationError("modalities", "only text output is supported")
    unsupported = {"audio": "audio output", "prediction": "predicted outputs",
                   "reasoning_effort": "reasoning (the model does not reason)",
                   "verbosity": "verbosity (a reasoning models' setting)",
                   "web_search_options": "web search", "moderation": "moderation"}
    for name, what in unsupported.items():
        if getattr(body, name) is not None:
            raise ValidationError(name, f"{what} is not supported by this server")
    if body.store:
        raise ValidationError("store", "this server does not store completions")
