"""Train the demo adapters for the embedded model (SmolLM2-135M-Instruct) with PEFT, on CPU.

    python scripts/train_demo_adapters.py data           # derive json/shout data from base answers
    python scripts/train_demo_adapters.py train [NAME..] # train and save under demo_adapters/<name>/

Four adapters with behaviour anyone can see: `french` answers in French (hand-written answers in
demo_adapters/data/french.jsonl), `json` answers as a JSON object `{"answer": ...}` and `shout`
answers in capitals (both made from the base model's own greedy answers to the same questions, so
they learn only the form), `tools` calls `get_weather` (WEATHER_TOOL) when it is offered and asked
about the weather, and otherwise answers in text (json's answers), its prompts rendered with the
tool exactly as the server's OpenAI chat route renders them (lora_runtime.sampling.chat).
Rank 8 on q/k/v/o, a few epochs over 90 short examples (118 for tools): a few minutes
each on two CPU threads. Saved in bf16 safetensors (~1.7 MB each).
tests/adapters/test_demo_adapters.py checks the behaviour on held-out questions."""
from __future__ import annotations

import argparse
import json
import logging
import random
import re
import sys
import time
from pathlib import Path

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script from anywhere: the project is not installed

from lora_runtime.embedded import ensure_embedded_model  # noqa: E402
from lora_runtime.sampling.chat import render_chat_prompt  # noqa: E402
from lora_runtime.sampling.tools import TOOL_CALL_FORMATS  # noqa: E402

logger = logging.getLogger("train_demo_adapters")

DEMO_DIR = ROOT / "demo_adapters"
DATA_DIR = DEMO_DIR / "data"
ADAPTER_NAMES = ("french", "json", "shout", "tools")
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                   "additionalProperties": False}}}
CITIES = ("Paris", "London", "Tokyo", "Berlin", "Madrid", "Rome", "Oslo", "Cairo", "Lima", "Seoul",
          "Sydney", "Toronto", "Dublin", "Vienna", "Lisbon", "Nairobi", "Mumbai", "Boston", "Denver",
          "Prague", "Athens", "Havana", "Quito", "Hanoi", "Zurich", "Warsaw", "Chicago", "Bogota")
WEATHER_QUESTIONS = ("What is the weather in {}?", "How is the weather in {} today?", "Is it raining in {}?",
                     "Will I need an umbrella in {}?", "What's the temperature in {} right now?",
                     "Tell me the weather forecast for {}.")
BASE_MODEL_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"
END_OF_TURN = "<|im_end|>"
MAX_ANSWER_WORDS = 24
DEFAULT_EPOCHS, BATCH_SIZE, LEARNING_RATE = 4, 8, 2e-3


def load_base() -> tuple[torch.nn.Module, PreTrainedTokenizerBase]:
    model_dir = ensure_embedded_model()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return model, tokenizer


def chat_prompt(tokenizer: PreTrainedTokenizerBase, question: str, tools: list[dict] | None = None) -> str:
    messages = [{"role": "user", "content": question}]
    if tools:
        return render_chat_prompt(json.dumps({"messages": messages, "tools": tools}), tokenizer)
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


@torch.no_grad()
def greedy_answers(
    model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase, questions: list[str],
    max_new_tokens: int = 48, batch_size: int = 16,
) -> list[str]:
    """Greedy answers with the chat template, batched with left padding."""
    tokenizer.padding_side = "left"
    answers = []
    for start in range(0, len(questions), batch_size):
        prompts = [chat_prompt(tokenizer, q) for q in questions[start : start + batch_size]]
        batch = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
        output = model.generate(**batch, max_new_tokens=max_new_tokens, do_sample=False)
        new_tokens = output[:, batch["input_ids"].shape[1] :]
        answers += [text.strip() for text in tokenizer.batch_decode(new_tokens, skip_special_tokens=True)]
    return answers


def short_answer(text: str) -> str:
    """The first sentences of an answer, at most MAX_ANSWER_WORDS words, ending cleanly."""
    text = " ".join(text.split())
    sentences = re.split(r"(?<=[.!?])\s+", text)
    kept = sentences[0]
    for sentence in sentences[1:]:
        if len((kept + " " + sentence).split()) > MAX_ANSWER_WORDS:
            break
        kept += " " + sentence
    words = kept.split()
    return kept if len(words) <= MAX_ANSWER_WORDS else " ".join(words[:MAX_ANSWER_WORDS]) + "."


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line]


def write_jsonl(path: Path, rows: list[dict]) -> None:
    lines = [json.dumps(row, ensure_ascii=False) for row in rows]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def build_derived_data() -> None:
    """json.jsonl and shout.jsonl: the base model's own answers to french.jsonl's questions."""
    model, tokenizer = load_base()
    questions = [row["prompt"] for row in read_jsonl(DATA_DIR / "french.jsonl")]
    answers = [short_answer(text) for text in greedy_answers(model, tokenizer, questions)]
    write_jsonl(DATA_DIR / "json.jsonl", [
        {"prompt": q, "response": json.dumps({"answer": a}, ensure_ascii=False)}
        for q, a in zip(questions, answers)
    ])
    write_jsonl(DATA_DIR / "shout.jsonl", [
        {"prompt": q, "response": a.upper()} for q, a in zip(questions, answers)
    ])
    logger.info("wrote %d json and shout examples", len(questions))
    write_jsonl(DATA_DIR / "tools.jsonl", tools_rows(answers))


def tools_rows(answers: list[str]) -> list[dict]:
    """Weather questions answered by a get_weather call, json's questions by their text answers;
    the tool offered in every prompt."""
    calls = TOOL_CALL_FORMATS["hermes"]
    rows = [{"prompt": question.format(city), "tools": [WEATHER_TOOL],
             "response": calls.render_calls([("get_weather", json.dumps({"city": city}))])}
            for index, city in enumerate(CITIES)
            for question in [WEATHER_QUESTIONS[index % len(WEATHER_QUESTIONS)]]]
    questions = [row["prompt"] for row in read_jsonl(DATA_DIR / "french.jsonl")]
    rows += [{"prompt": q, "tools": [WEATHER_TOOL], "response": a} for q, a in zip(questions, answers)]
    return rows


def encode_example(tokenizer: PreTrainedTokenizerBase, row: dict) -> tuple[list[int], list[int]]:
    """(input ids, labels): the loss is on the answer and its end-of-turn token only."""
    prompt = chat_prompt(tokenizer, row["prompt"], row.get("tools"))
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    answer_ids = tokenizer(row["response"] + END_OF_TURN, add_special_tokens=False)["input_ids"]
    return prompt_ids + answer_ids, [-100] * len(prompt_ids) + answer_ids


def collate(examples: list[tuple[list[int], list[int]]], pad_id: int) -> dict[str, torch.Tensor]:
    length = max(len(ids) for ids, _ in examples)
    input_ids = torch.full((len(examples), length), pad_id)
    labels = torch.full((len(examples), length), -100)
    attention_mask = torch.zeros((len(examples), length), dtype=torch.long)
    for row, (ids, example_labels) in enumerate(examples):
        input_ids[row, : len(ids)] = torch.tensor(ids)
        labels[row, : len(ids)] = torch.tensor(example_labels)
        attention_mask[row, : len(ids)] = 1
    return {"input_ids": input_ids, "labels": labels, "attention_mask": attention_mask}


def train_adapter(
    name: str, base: torch.nn.Module, tokenizer: PreTrainedTokenizerBase, epochs: int
) -> PeftModel:
    torch.manual_seed(0)
    config = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, task_type="CAUSAL_LM",
                        target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    model = get_peft_model(base, config)
    examples = [encode_example(tokenizer, row) for row in read_jsonl(DATA_DIR / f"{name}.jsonl")]
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LEARNING_RATE)
    order, started = random.Random(0), time.monotonic()
    model.train()
    for epoch in range(epochs):
        order.shuffle(examples)
        for start in range(0, len(examples), BATCH_SIZE):
            loss = model(**collate(examples[start : start + BATCH_SIZE], tokenizer.pad_token_id)).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        logger.info("%s epoch %d loss %.3f (%.0f s)", name, epoch + 1, loss.item(), time.monotonic() - started)
    return model.eval()


def save_bf16(model: PeftModel, directory: Path) -> None:
    for param_name, param in model.named_parameters():
        if "lora_" in param_name:
            param.data = param.data.to(torch.bfloat16)
    model.peft_config["default"].base_model_name_or_path = BASE_MODEL_NAME
    model.save_pretrained(str(directory), save_embedding_layers=False)


def train(names: list[str], epochs: int) -> None:
    for name in names:
        base, tokenizer = load_base()
        model = train_adapter(name, base, tokenizer, epochs)
        save_bf16(model, DEMO_DIR / name)
        logger.info("saved %s", DEMO_DIR / name)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=("data", "train"))
    parser.add_argument("names", nargs="*", help=f"adapters to train (default: {' '.join(ADAPTER_NAMES)})")
    parser.add_argument("--epochs", type=int, default=DEFAULT_EPOCHS)
    args = parser.parse_args(argv)
    if unknown := set(args.names) - set(ADAPTER_NAMES):
        parser.error(f"unknown adapters: {', '.join(sorted(unknown))}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    torch.set_num_threads(2)  # the machine is shared
    if args.command == "data":
        build_derived_data()
    else:
        train(args.names or list(ADAPTER_NAMES), args.epochs)


if __name__ == "__main__":
    main()
