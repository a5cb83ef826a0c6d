"""Regenerate this example's tokenizer.json and config.json (committed; rerun only to change
them): a byte-level BPE of 2048 tokens trained on Python's bundled documentation, and a
Llama config of ~2.4M parameters that embeds exactly that vocabulary.

    .venv/bin/python examples/tiny-llama/make.py
"""

from __future__ import annotations

from pathlib import Path
from pydoc_data.topics import topics

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig

HERE = Path(__file__).resolve().parent
VOCAB = 2048


def main() -> None:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator((topics[k] for k in sorted(topics)), trainer)
    tok.save(str(HERE / "tokenizer.json"))
    config = LlamaConfig(
        vocab_size=tok.get_vocab_size(),
        hidden_size=192,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        eos_token_id=tok.token_to_id("<|endoftext|>"),
        bos_token_id=tok.token_to_id("<|endoftext|>"),
    )
    config.save_pretrained(HERE)
    (HERE / "tokenizer_config.json").write_text('{"eos_token": "<|endoftext|>"}\n')


if __name__ == "__main__":
    main()
