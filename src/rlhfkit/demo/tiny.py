"""Build tiny models and tokenizers locally (no downloads): for the demo world and for tests.

The tokenizer is a byte-level BPE trained by the `tokenizers` library on given text and wrapped as a
transformers fast tokenizer, so it behaves like a real one (BOS/EOS/pad, save_pretrained, decode).
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

SPECIALS = ["<pad>", "<s>", "</s>"]


def build_tokenizer(texts: list[str], vocab_size: int = 384, chat_template: str | None = None):
    """A byte-level BPE tokenizer trained on `texts`; pad id 0, BOS id 1 (added automatically), EOS id 2."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", 1)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    if chat_template:
        fast.chat_template = chat_template
    return fast


def build_tiny_llama(vocab_size: int, hidden: int = 64, layers: int = 2, heads: int = 4, seed: int = 0,
                     max_positions: int = 256) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=hidden * 2,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
                         max_position_embeddings=max_positions, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                         tie_word_embeddings=True)
    return LlamaForCausalLM(config)


def save_model_folder(model, tokenizer, folder: str | Path) -> Path:
    folder = Path(folder)
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    return folder
