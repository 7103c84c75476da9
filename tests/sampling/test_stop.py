"""Stop strings over text arriving token by token, the finish-reason order, incremental decoding."""
from __future__ import annotations

import pytest

from lora_runtime.core import SamplingParams
from lora_runtime.detokenizer import IncrementalDetokenizer
from lora_runtime.sampling import StopCriteria
from lora_runtime.sampling.stop import StopStringMatcher

EOS = 2


@pytest.mark.parametrize(
    ("pieces", "stops", "hit_at", "expected"),
    [
        (["Hel", "lo wo", "rld"], ["o w"], 1, "o w"),  # spans two pieces
        (["a", "b", "c", "d"], ["bcd"], 3, "bcd"),  # spans three
        (["The end", ".\n", "More"], ["."], 1, "."),  # ends inside a piece
        (["ab", "cd"], ["d", "bc", "nope"], 1, "bc"),  # the stop that ends first wins
        (["abc"], [], None, None),
    ],
)
def test_stop_strings_across_pieces(pieces, stops, hit_at, expected) -> None:
    matcher = StopStringMatcher(stops)
    hits = [matcher.push(piece) for piece in pieces]
    first = next((i for i, hit in enumerate(hits) if hit is not None), None)
    assert first == hit_at
    assert (hits[hit_at] if hit_at is not None else None) == expected


def test_finish_reason_order_length_then_eos_then_stop() -> None:
    def first_reason(params: SamplingParams, tokens: list[tuple[int, str]]) -> tuple[int, str | None]:
        criteria = StopCriteria(params, {EOS})
        for i, (token_id, text) in enumerate(tokens):
            if (reason := criteria.check(token_id, text)) is not None:
                return i, reason
        return len(tokens), None

    eos_with_stop_text = [(7, "a"), (EOS, "STOP")]
    assert first_reason(SamplingParams(max_new_tokens=2, stop=("STOP",)), eos_with_stop_text) == (1, "length")
    assert first_reason(SamplingParams(max_new_tokens=5, stop=("STOP",)), eos_with_stop_text) == (1, "eos_token")
    ignore = SamplingParams(max_new_tokens=5, stop=("STOP",), ignore_eos_token=True)
    assert first_reason(ignore, eos_with_stop_text) == (1, "stop_sequence")
    assert first_reason(SamplingParams(max_new_tokens=5, ignore_eos_token=True), eos_with_stop_text) == (2, None)
    assert first_reason(SamplingParams(max_new_tokens=3), [(7, "a"), (8, "b"), (9, "c")]) == (2, "length")


TEXTS = ["Hello, world! Ça va? Ünïcödé", "Emoji 🦙🚀 and 漢字 mixed", "  leading spaces\n\ttabs", "The answer is 42. Done"]


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_pieces_concatenate_to_the_decoded_text(text: str, tokenizer) -> None:
    prompt_ids = tokenizer("Say something:")["input_ids"]
    generated = tokenizer(text, add_special_tokens=False)["input_ids"]
    decoder = IncrementalDetokenizer(tokenizer, prompt_ids)
    pieces = [decoder.add_token(token_id) for token_id in generated]
    full = tokenizer.decode(prompt_ids + generated)
    assert "".join(pieces) == full[len(tokenizer.decode(prompt_ids)) :] == text
    assert all("\ufffd" not in piece for piece in pieces)


def test_emoji_bytes_are_held_back_until_complete(tokenizer) -> None:
    generated = tokenizer("🦙", add_special_tokens=False)["input_ids"]
    assert len(generated) > 1  # byte-level pieces of one character
    decoder = IncrementalDetokenizer(tokenizer, [EOS])
    assert [decoder.add_token(t) for t in generated] == [""] * (len(generated) - 1) + ["🦙"]


def test_stop_string_spanning_real_tokens_keeps_its_text(tokenizer) -> None:
    ids = tokenizer(" The answer is 42. Done here", add_special_tokens=False)["input_ids"]
    criteria = StopCriteria(SamplingParams(max_new_tokens=50, stop=("42. D",)), {EOS})
    decoder = IncrementalDetokenizer(tokenizer, [EOS])
    text, reason = "", None
    for token_id in ids:
        piece = decoder.add_token(token_id)
        text += piece
        if (reason := criteria.check(token_id, piece)) is not None:
            break
    assert reason == "stop_sequence"
    assert text.endswith("42. Done") and "here" not in text


def test_stop_string_over_single_character_pieces() -> None:
    """Each piece shorter than the kept tail: the tail must keep all of the recent text."""
    from lora_runtime.sampling.stop import StopStringMatcher

    matcher = StopStringMatcher(("8, 9",))
    hits = [matcher.push(piece) for piece in [" ", "7", ",", " ", "8", ",", " ", "9"]]
    assert hits == [None] * 7 + ["8, 9"]
