"""apply_chat_template: message lists and plain text, rendered as transformers renders them."""
from __future__ import annotations

import copy
import json

import pytest

from lora_runtime.errors import ValidationError
from lora_runtime.sampling import render_chat_prompt

ADAPTER_TEMPLATE = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}" \
    "{% if add_generation_prompt %}[assistant] {% endif %}"


def test_message_list_renders_like_transformers(tokenizer) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"},
                {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Capital of France?"}]
    expected = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert render_chat_prompt(json.dumps(messages), tokenizer) == expected
    assert expected.endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize("text", ["What is 2+2?", "[not json", "{\"a\": 1}", "42"])
def test_plain_text_is_one_user_message(text: str, tokenizer) -> None:
    expected = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                             add_generation_prompt=True)
    assert render_chat_prompt(text, tokenizer) == expected


def test_adapter_template_wins_over_the_base_one(tokenizer) -> None:
    rendered = render_chat_prompt(json.dumps([{"role": "user", "content": "Hi"}]), tokenizer, ADAPTER_TEMPLATE)
    assert rendered == "[user] Hi\n[assistant] "


@pytest.mark.parametrize(
    "inputs",
    ["[]", '[{"role": "user"}]', '[{"content": "x"}]', '["hello"]', '[{"role": "user", "content": 3}]',
     '[{"role": "", "content": "x"}]'],
)
def test_invalid_message_lists_are_refused(inputs: str, tokenizer) -> None:
    with pytest.raises(ValidationError) as error:
        render_chat_prompt(inputs, tokenizer)
    assert error.value.field == "inputs"


def test_a_model_without_template_is_refused(tokenizer) -> None:
    bare = copy.deepcopy(tokenizer)
    bare.chat_template = None
    with pytest.raises(ValidationError) as error:
        render_chat_prompt("hi", bare)
    assert error.value.field == "apply_chat_template"
