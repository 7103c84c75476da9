"""Incremental detokenization: the pieces add up to the tokenizer's own decode, also for multi-byte
characters split over byte-level tokens and for words with leading spaces."""
from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from lora_runtime.detokenizer import IncrementalDetokenizer, TokenTexts

TEXTS = [
    " leading space and  double  spaces",
    "Émojis 🌊🔥 and accents: café, naïve, 東京",
    "code:\n\tdef f(x):\n\t\treturn x ** 2\n",
    "<|im_end|> special in the middle, then text",
]


@pytest.fixture(scope="module")
def tokenizer(embedded_model_dir):
    return AutoTokenizer.from_pretrained(embedded_model_dir)


@pytest.mark.parametrize("text", TEXTS)
def test_pieces_add_up_to_the_full_decode(tokenizer, text: str) -> None:
    prompt_ids = tokenizer("Say something:")["input_ids"]
    generated = tokenizer(text, add_special_tokens=False)["input_ids"]
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids)
    pieces = [detokenizer.add_token(token_id) for token_id in generated]
    pieces.append(detokenizer.flush())
    assert "".join(pieces) == tokenizer.decode(generated, skip_special_tokens=True)
    assert all("\ufffd" not in piece for piece in pieces), "no piece may end inside a character"


def test_multibyte_character_is_held_until_complete(tokenizer) -> None:
    generated = tokenizer("🌊", add_special_tokens=False)["input_ids"]
    assert len(generated) > 1, "the emoji must span several byte-level tokens for this test"
    detokenizer = IncrementalDetokenizer(tokenizer, [1])
    pieces = [detokenizer.add_token(token_id) for token_id in generated]
    assert pieces[:-1] == [""] * (len(generated) - 1) and pieces[-1] == "🌊"


def test_token_texts_are_the_tokenizers_own_decode_of_each_token(tokenizer) -> None:
    token_texts = TokenTexts(tokenizer)
    ids = [*tokenizer("Émojis 🌊 café", add_special_tokens=False)["input_ids"], *tokenizer.all_special_ids]
    for token_id in ids + ids:  # the second time from the texts kept
        assert token_texts[token_id] == tokenizer.decode([token_id], skip_special_tokens=False)
    shared = IncrementalDetokenizer(tokenizer, [1], token_texts=token_texts)
    assert [shared.token_text(token_id) for token_id in ids] == [token_texts[token_id] for token_id in ids]
