"""Training corpora (:mod:`megacp.train.data`): sources, packing with document boundaries, the
data-parallel split. In-process, no tokenizer model needed (a character tokenizer stands in)."""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

import pytest
import torch

from megacp.train.data import (
    CorpusBatches,
    CorpusError,
    Prefetcher,
    StreamPosition,
    concat_sequences,
    pack_documents,
    read_documents,
    resolve_corpus,
    stdlib_sources,
)

EOS = 0


class CharTokenizer:
    """``ord(c)`` per character (a stand-in with the Hugging Face call signature)."""

    def __call__(self, text: str, add_special_tokens: bool = True, verbose: bool = True) -> dict:
        return {"input_ids": [ord(c) for c in text]}


def test_pack_documents_marks_boundaries_and_splits_long_documents() -> None:
    docs = [[1, 2, 3], [4], [5, 6, 7, 8, 9, 10, 11], [12, 13]]
    packed = list(pack_documents(docs, 5))
    assert [s.input_ids.tolist() for s in packed] == [[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]]  # the tail waits for more
    assert [s.cu_seqlens.tolist() for s in packed] == [[0, 3, 4, 5], [0, 5]]
    assert all(s.cu_seqlens.dtype == torch.int32 and s.input_ids.dtype == torch.long for s in packed)
    joined = concat_sequences(packed)
    assert joined.input_ids.tolist() == list(range(1, 11)) and joined.cu_seqlens.tolist() == [0, 3, 4, 5, 10]
    with pytest.raises(ValueError, match="seq_len must be >= 1"):
        next(pack_documents(docs, 0))


def test_sources_documents_and_dp_split(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "a.txt").write_text("abc")
    (tmp_path / "b.jsonl").write_text(json.dumps({"text": "de"}) + "\n\n" + json.dumps({"text": ""}) + "\n")
    (tmp_path / "skip.bin").write_bytes(b"\xff\xfe")
    sources = resolve_corpus([tmp_path])
    assert [(s.path.name, s.kind) for s in sources] == [("b.jsonl", "jsonl"), ("a.txt", "text")]
    assert [d for s in sources for d in read_documents(s)] == ["de", "", "abc"]
    # the stream: d e EOS a b c EOS, repeated; 3-token sequences, replica r of 2 takes sequences r, r+2, ...
    stream = [ord("d"), ord("e"), EOS, ord("a"), ord("b"), ord("c"), EOS] * 6
    seqs = [stream[i: i + 3] for i in range(0, len(stream) - 2, 3)]
    for rank in (0, 1):
        batches = CorpusBatches(sources, CharTokenizer(), eos_id=EOS, seq_len=3, micro_batch=2, dp_size=2, dp_rank=rank)
        first, second = next(batches), next(batches)
        assert first.input_ids.tolist() == seqs[rank] + seqs[rank + 2]
        assert second.input_ids.tolist() == seqs[rank + 4] + seqs[rank + 6]
    assert first.cu_seqlens.tolist()[0] == 0 and first.cu_seqlens.tolist()[-1] == 6


def test_batches_started_at_a_batch_end_continue_the_stream(tmp_path: Path) -> None:
    """A stream started at a batch's ``end`` gives what the uninterrupted stream gives after that
    batch, for every replica (the corpus read again past its end; a document split over batches;
    empty documents counted), without tokenising the documents it passes over."""
    (tmp_path / "a.txt").write_text("abcdefgh")
    (tmp_path / "b.jsonl").write_text("\n".join(json.dumps({"text": t}) for t in ("", "xy", "pqrstuvw", "z")))
    sources = resolve_corpus([tmp_path])

    class Counting(CharTokenizer):
        texts: list[str] = []

        def __call__(self, text: str, add_special_tokens: bool = True, verbose: bool = True) -> dict:
            self.texts.append(text)
            return super().__call__(text, add_special_tokens, verbose)

    def batches(rank: int, start: StreamPosition | None = None, tokenizer: CharTokenizer | None = None):
        return CorpusBatches(sources, tokenizer or CharTokenizer(), eos_id=EOS, seq_len=5, micro_batch=2, dp_size=2,
                             dp_rank=rank, start=start or StreamPosition())

    for rank in (0, 1):
        whole = batches(rank)
        expected = [next(whole) for _ in range(9)]
        assert [b.end for b in expected[:2]] == [StreamPosition(3, 8), StreamPosition(8, 5)]
        # the stream: abcdefgh EOS | (empty) | xy EOS | pqrstuvw EOS | z EOS | again; 20 tokens a batch
        for stop, first_text in ((1, "pqrstuvw"), (2, "pqrstuvw"), (5, "abcdefgh")):
            counting = Counting()
            counting.texts = []
            resumed = batches(rank, expected[stop - 1].end, counting)
            for want in expected[stop:]:
                got = next(resumed)
                assert got.input_ids.tolist() == want.input_ids.tolist()
                assert got.cu_seqlens.tolist() == want.cu_seqlens.tolist() and got.end == want.end
            assert counting.texts[0] == first_text  # the documents before the start are not tokenised
    assert next(batches(0, StreamPosition(3, 3))).input_ids.tolist()[:2] == [ord("s"), ord("t")]


def test_corpus_errors(tmp_path: Path) -> None:
    with pytest.raises(CorpusError, match="does not exist"):
        resolve_corpus([tmp_path / "absent"])
    with pytest.raises(CorpusError, match="has no .txt"):
        resolve_corpus([tmp_path])
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"body": "x"}\n')
    with pytest.raises(CorpusError, match=r'bad.jsonl:1: expected an object with a string "text" field'):
        list(read_documents(resolve_corpus([bad])[0]))
    (tmp_path / "dataset_info.json").write_text("{}")
    try:
        import datasets  # noqa: F401
    except ImportError:
        with pytest.raises(CorpusError, match="datasets package is not installed"):
            resolve_corpus([tmp_path])
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    batches = CorpusBatches(resolve_corpus([empty]), CharTokenizer(), eos_id=EOS, seq_len=4, micro_batch=1,
                            dp_size=1, dp_rank=0)
    with pytest.raises(CorpusError, match="has no text to train on"):
        next(batches)


def test_prefetcher_keeps_order_and_raises_where_the_source_fails(tmp_path: Path) -> None:
    sources = [tmp_path / f"{i}.txt" for i in range(3)]
    for i, path in enumerate(sources):
        path.write_text("abcdefg"[: 2 + i])
    direct = CorpusBatches(resolve_corpus(sources), CharTokenizer(), eos_id=EOS, seq_len=3, micro_batch=1,
                           dp_size=1, dp_rank=0)
    with Prefetcher(CorpusBatches(resolve_corpus(sources), CharTokenizer(), eos_id=EOS, seq_len=3, micro_batch=1,
                                  dp_size=1, dp_rank=0), depth=2) as ahead:
        for _ in range(7):  # past the end of the corpus: it is read again
            a, b = next(direct), next(ahead)
            assert a.input_ids.tolist() == b.input_ids.tolist() and a.cu_seqlens.tolist() == b.cu_seqlens.tolist()

    def failing():
        yield 1
        raise CorpusError("bad.jsonl:2: not JSON")

    with Prefetcher(failing()) as ahead:
        assert next(ahead) == 1
        for _ in range(2):
            with pytest.raises(CorpusError, match="bad.jsonl:2"):
                next(ahead)
    with Prefetcher(iter([1, 2])) as ahead:
        assert list(ahead) == [1, 2]
    with pytest.raises(ValueError, match="depth must be >= 1"):
        Prefetcher(iter([]), depth=0)


def test_default_corpus_is_the_standard_library() -> None:
    sources = stdlib_sources()
    root = Path(sysconfig.get_paths()["stdlib"])
    names = {s.path.relative_to(root).as_posix() for s in sources}
    assert "os.py" in names and "json/__init__.py" in names
    assert not any("site-packages" in n for n in names)
    os_source = next(s for s in sources if s.path == root / "os.py")
    assert "def makedirs(" in next(read_documents(os_source))
