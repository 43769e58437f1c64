"""The tokenised-corpus cache: the batches it feeds equal tokenising as the run goes (from the start
and from a resumed position), a second build reuses it and says so, and a changed corpus, EOS or
tokenizer makes a new one, as does a cache whose files changed since it was made."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from megacp.train.data import CorpusBatches, CorpusError, StreamPosition, resolve_corpus
from megacp.train.token_cache import build_token_cache, corpus_key

EOS = 0


class BatchCharTokenizer:
    """``ord(c)`` per character, called with one text or a list (as a Hugging Face tokenizer)."""

    def __init__(self, shift: int = 0) -> None:
        self.shift = shift

    def get_vocab(self) -> dict[str, int]:
        return {"shift": self.shift}

    def __call__(self, text, add_special_tokens: bool = True, verbose: bool = True) -> dict:
        def encode(t: str) -> list[int]:
            return [ord(c) + self.shift for c in t]
        return {"input_ids": [encode(t) for t in text] if isinstance(text, list) else encode(text)}


def _corpus(root: Path) -> list:
    (root / "a.txt").write_text("hello world", encoding="utf-8")
    (root / "b.jsonl").write_text("\n".join(json.dumps({"text": t}) for t in ("ab", "", "long document here")),
                                  encoding="utf-8")
    return resolve_corpus([root / "a.txt", root / "b.jsonl"])


START = StreamPosition()
"""The corpus stream's beginning."""


def _batches(sources, tokenizer, cache=None, start=START, n=6) -> list[torch.Tensor]:
    it = CorpusBatches(sources, tokenizer, eos_id=EOS, seq_len=7, micro_batch=2, dp_size=1, dp_rank=0, start=start,
                       documents=None if cache is None else cache.stream(skip=start.document))
    return [next(it).input_ids for _ in range(n)]


def test_cached_batches_equal_tokenising_and_reuse(tmp_path: Path) -> None:
    sources, tok = _corpus(tmp_path), BatchCharTokenizer()
    cache = build_token_cache(sources, tok, eos_id=EOS, root=tmp_path / "cache")
    assert not cache.reused and cache.documents == 4 and len(cache.tokens) == 12 + 3 + 19  # EOS after each text
    for a, b in zip(_batches(sources, tok), _batches(sources, tok, cache)):
        assert torch.equal(a, b)
    resumed = StreamPosition(document=3, offset=4)
    for a, b in zip(_batches(sources, tok, start=resumed), _batches(sources, tok, cache, start=resumed)):
        assert torch.equal(a, b)
    again = build_token_cache(sources, tok, eos_id=EOS, root=tmp_path / "cache")
    assert again.reused and again.path == cache.path
    assert again.describe().startswith("reused the tokenised corpus: 4 documents, 34 tokens (")
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [cache.path.name]  # no temporary left


def test_key_follows_corpus_eos_and_tokenizer(tmp_path: Path) -> None:
    sources = _corpus(tmp_path)
    key = corpus_key(sources, BatchCharTokenizer(), EOS)
    assert corpus_key(sources, BatchCharTokenizer(), EOS) == key
    assert corpus_key(sources, BatchCharTokenizer(shift=1), EOS) != key
    assert corpus_key(sources, BatchCharTokenizer(), 1) != key
    (tmp_path / "a.txt").write_text("hello world!", encoding="utf-8")
    assert corpus_key(sources, BatchCharTokenizer(), EOS) != key


def test_empty_corpus_and_unwritable_root(tmp_path: Path) -> None:
    (tmp_path / "empty.txt").write_text("", encoding="utf-8")
    cache = build_token_cache(resolve_corpus([tmp_path / "empty.txt"]), BatchCharTokenizer(), eos_id=EOS,
                              root=tmp_path / "cache")
    with pytest.raises(CorpusError, match="has no text to train on"):
        next(cache.stream())
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(CorpusError, match="cannot write the token cache under"):
        build_token_cache(_corpus(tmp_path), BatchCharTokenizer(), eos_id=EOS, root=blocker / "sub")
    assert np.load(cache.path / "offsets.npy").tolist() == [0, 0]


@pytest.mark.parametrize("damage", ["shuffled", "truncated", "missing"])
def test_a_changed_cache_is_made_again(tmp_path: Path, damage: str) -> None:
    """tokens.npy shuffled in place (same size), cut short or gone: the cache no longer matches its
    recorded digest, so the next build tokenises again (and says so) and the batches are the corpus's."""
    sources, tok = _corpus(tmp_path), BatchCharTokenizer()
    cache = build_token_cache(sources, tok, eos_id=EOS, root=tmp_path / "cache")
    tokens = cache.path / "tokens.npy"
    if damage == "shuffled":
        arr = np.load(tokens)
        np.save(tokens, arr[np.random.default_rng(0).permutation(len(arr))])
    elif damage == "truncated":
        tokens.write_bytes(tokens.read_bytes()[:-8])
    else:
        tokens.unlink()
    again = build_token_cache(sources, tok, eos_id=EOS, root=tmp_path / "cache")
    assert not again.reused and again.rebuilt and "did not match its recorded digest" in again.describe()
    for a, b in zip(_batches(sources, tok), _batches(sources, tok, again)):
        assert torch.equal(a, b)
    assert build_token_cache(sources, tok, eos_id=EOS, root=tmp_path / "cache").reused
