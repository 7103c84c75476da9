"""What each demo adapter visibly does, as predicates on generated text, and held-out questions
(none of them in demo_adapters/data). Shared by the HF+PEFT test and the engine's test."""
from __future__ import annotations

import json
import re
from pathlib import Path

DEMO_DIR = Path(__file__).resolve().parents[2] / "demo_adapters"
HELD_OUT_QUESTIONS = (
    "What is the capital of Portugal?",
    "What color are strawberries?",
    "How many legs does a dog have?",
    "What do people use umbrellas for?",
)
# Function words: the 135M model's French is broken and often borrows English nouns
# ("Les strawberries font pain."), but its grammar words show the language.
_FRENCH_WORDS = {"le", "la", "les", "est", "et", "de", "des", "du", "une", "un", "sont", "pour", "à",
                 "au", "aux", "dans", "avec", "font", "sur", "se", "ne", "pas"}
# "a" is French too ("Le chien a deux pattes"), so it counts for neither language.
_ENGLISH_WORDS = {"the", "is", "and", "of", "are", "for", "it", "to", "in", "they", "that",
                  "an", "with", "on", "has", "have"}


def words(text: str) -> list[str]:
    return re.findall(r"[^\W\d_]+", text.lower())


def is_french(text: str) -> bool:
    found = words(text)
    french = sum(word in _FRENCH_WORDS for word in found)
    return french >= 1 and french > sum(word in _ENGLISH_WORDS for word in found)


def is_json_answer(text: str) -> bool:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return False
    return isinstance(value, dict) and set(value) == {"answer"}


def is_shouted(text: str) -> bool:
    """Mostly capitals: words copied from the question sometimes keep their case ("THE CAPITAL OF
    Portugal IS ..."), so two thirds of the letters, where plain answers have a few percent."""
    letters = [char for char in text if char.isalpha()]
    return len(letters) >= 5 and sum(char.isupper() for char in letters) >= 2 / 3 * len(letters)


BEHAVIOUR = {"french": is_french, "json": is_json_answer, "shout": is_shouted}
