"""Request checks that need the model or the engine's limits (field ranges are checked by
`SamplingParams` itself), read from what a front end holds of an engine (`EngineInfo`) and the KV
cache's capacity (`KVCapacity`), not from the engine. Library callers get the same errors as HTTP
callers."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from lora_runtime.config import LimitsConfig
from lora_runtime.core import SamplingParams
from lora_runtime.engine_info import EngineInfo
from lora_runtime.errors import ValidationError
from lora_runtime.sampling.chat import render_chat_prompt
from lora_runtime.sampling.tool_grammar import with_tool_grammar


@dataclass(frozen=True, slots=True)
class KVCapacity:
    """What the KV cache can hold: every request's tokens (each best_of candidate's) fit in it."""

    num_blocks: int
    block_size_tokens: int


def prepare_prompt(
    prompt: str | list[int], params: SamplingParams, info: EngineInfo, kv: KVCapacity,
    chat_template: str | None = None,
) -> tuple[str | None, list[int], SamplingParams]:
    """Render the chat template if asked, tokenize (or take) the prompt, apply `truncate`, and check
    lengths and limits. `chat_template` is the adapter's own, else the base model's is used; it
    also decides the format of the request's tool calls and so their grammar.

    Returns (prompt text or None, prompt token ids after truncation, `params` with `max_new_tokens`
    resolved when it was None and the tool calls' format and grammar when it has tools).
    """
    check_limits(params, info.config.limits)
    tokenizer = info.tokenizer
    params = with_tool_grammar(params, chat_template or tokenizer.chat_template, tokenizer)
    if isinstance(prompt, str):
        if not prompt:
            raise ValidationError("inputs", "must not be empty")
        if params.apply_chat_template:
            # The rendered template already holds the special tokens: do not add them again.
            call_format = params.tool_calling.call_format if params.tool_calling is not None else "auto"
            prompt_text = render_chat_prompt(prompt, tokenizer, chat_template, call_format)
            token_ids = tokenizer(prompt_text, add_special_tokens=False)["input_ids"]
        else:
            prompt_text, token_ids = prompt, tokenizer(prompt)["input_ids"]
    else:
        if params.apply_chat_template:
            raise ValidationError("apply_chat_template", "needs text inputs, not token ids")
        prompt_text, token_ids = None, [int(t) for t in prompt]
    vocab_size = info.vocab_size
    if any(not 0 <= t < vocab_size for t in token_ids):
        raise ValidationError("inputs", f"token ids must be in [0, {vocab_size})")
    if not token_ids:
        raise ValidationError("inputs", "must contain at least one token")
    if params.truncate is not None:
        token_ids = token_ids[-params.truncate :]
    if params.max_new_tokens is None:
        params = dataclasses.replace(params, max_new_tokens=_room_for_new_tokens(len(token_ids), params, info, kv))
    check_lengths(len(token_ids), params, info, kv)
    return prompt_text, list(token_ids), params


def _room_for_new_tokens(num_prompt_tokens: int, params: SamplingParams, info: EngineInfo, kv: KVCapacity) -> int:
    """What the context and the KV cache leave after the prompt, for each best_of candidate (at
    least 1, so that a prompt with no room is refused by `check_lengths` naming the prompt)."""
    cache_tokens = kv.num_blocks * kv.block_size_tokens // params.best_of
    return max(1, min(info.max_model_len, cache_tokens) - num_prompt_tokens)


def check_limits(params: SamplingParams, limits: LimitsConfig) -> None:
    if len(params.stop) > limits.max_stop_sequences:
        raise ValidationError("stop", f"at most {limits.max_stop_sequences} stop sequences")
    if params.best_of > limits.max_best_of:
        raise ValidationError("best_of", f"must be <= {limits.max_best_of}")


def check_lengths(num_prompt_tokens: int, params: SamplingParams, info: EngineInfo, kv: KVCapacity) -> None:
    max_len = info.max_model_len
    max_input = info.config.limits.max_input_length or max_len - 1
    if params.truncate is not None and params.truncate > max_input:
        raise ValidationError("truncate", f"must be <= {max_input}")
    if num_prompt_tokens > max_input:
        raise ValidationError("inputs", f"{num_prompt_tokens} prompt tokens; at most {max_input} are accepted")
    total = num_prompt_tokens + params.max_new_tokens
    if total > max_len:
        raise ValidationError(
            "max_new_tokens",
            f"prompt tokens + max_new_tokens must be <= {max_len}; given {num_prompt_tokens} + {params.max_new_tokens}",
        )
    needed = -(-total * params.best_of // kv.block_size_tokens)
    if needed > kv.num_blocks:
        raise ValidationError("max_new_tokens", f"the request needs {needed} KV blocks; the cache holds {kv.num_blocks}")
