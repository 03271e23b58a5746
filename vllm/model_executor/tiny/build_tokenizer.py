"""Train the built-in tiny checkpoint's byte-level BPE tokenizer (offline, deterministic).

The result is committed as `assets/tokenizer.json`; this script documents how it was made:
    python -m vllm.model_executor.tiny.build_tokenizer
Corpus: the English text of Python's bundled documentation topics (`pydoc_data.topics`).
"""

from __future__ import annotations

import os

SPECIAL_TOKENS = [
    "<|endoftext|>",
    "[gMASK]",
    "<sop>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|observation|>",
]
VOCAB_SIZE = 1024


def corpus() -> list[str]:
    from pydoc_data.topics import topics

    return [topics[k] for k in sorted(topics)]


def build(out_path: str) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    tok.save(out_path)


if __name__ == "__main__":
    build(os.path.join(os.path.dirname(__file__), "assets", "tokenizer.json"))
