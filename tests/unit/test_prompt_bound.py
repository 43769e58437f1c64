"""The server's refusal of a text too long for the context before it is tokenised
(:func:`~megacp.generate.requests.check_text_tokens`): the bound never exceeds the real token count,
for a byte-level BPE tokenizer trained here and the tests' character tokenizer, on ASCII, multi-byte
and whitespace-run texts."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from megacp.generate.requests import check_text_tokens, longest_token
from tests.helpers.hf_models import save_char_tokenizer


def _byte_level_bpe() -> object:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = ["the quick brown fox jumps over the lazy dog " * 20, "    " * 50, "ünïcödé текст 文字 " * 20,
              "def f(x):\n        return x\n" * 20]
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>"],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")


def _texts(seed: int) -> list[str]:
    rng = random.Random(seed)
    pieces = ["the ", "quick ", "    ", "\n        ", "ünïcödé ", "文字", "текст ", "<|endoftext|>", "x", "🙂"]
    return ["".join(rng.choice(pieces) for _ in range(rng.randint(1, 400))) for _ in range(40)] + [" " * 2000]


@pytest.mark.parametrize("kind", ["byte_level_bpe", "characters"])
def test_the_bound_never_exceeds_the_tokens(kind: str, tmp_path: Path) -> None:
    """Each text's bound ``ceil(chars / longest)`` is at most its token count, and a context of
    exactly the bound refuses it while one token more does not."""
    if kind == "characters":
        from transformers import AutoTokenizer

        save_char_tokenizer(tmp_path)
        tokenizer = AutoTokenizer.from_pretrained(str(tmp_path))
    else:
        tokenizer = _byte_level_bpe()
    longest = longest_token(tokenizer)
    assert longest >= 4
    for text in _texts(1):
        least = -(-len(text) // longest)
        assert least <= len(tokenizer(text)["input_ids"]), text
        with pytest.raises(ValueError, match=f"^the prompt of {len(text)} characters is at least {least} tokens"):
            check_text_tokens(len(text), longest, least)
        check_text_tokens(len(text), longest, least + 1)


def test_no_tokenizer_checks_nothing() -> None:
    check_text_tokens(10**9, 0, 8)
