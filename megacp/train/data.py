"""Training corpora: documents read from text / JSONL files or a ``datasets`` directory, tokenised
and packed into sequences of a fixed number of tokens.

A corpus is a list of sources (:func:`resolve_corpus`), read in a fixed order:

* a text file (UTF-8), one document per file;
* a ``.jsonl`` file, one document per line (its ``"text"`` field);
* a directory saved by ``datasets`` (``Dataset.save_to_disk``; needs the ``datasets`` package),
  one document per row (its ``"text"`` column);
* any other directory: every file below it ending in :data:`TEXT_SUFFIXES` or ``.jsonl``, sorted;
* nothing: the default corpus, the ``.py`` files of the running Python's standard library
  (present wherever Python is, nothing to download).

Packing (:func:`pack_documents`): each document's tokens get the EOS token appended and are laid
back to back; the stream is cut every ``seq_len`` tokens. A :class:`PackedSequence` records where
the documents (or the pieces of them that fall into it) start, as ``cu_seqlens``, so that
attention and the loss never cross a document boundary. The corpus is read again from the start
when it runs out, as often as training needs. Data-parallel replica ``d`` of ``D`` takes the
sequences ``d, d + D, d + 2D, ...`` (:class:`CorpusBatches`); every CP and TP rank of the replica
reads the same ones.

Every sequence records where the stream stands after it (:class:`StreamPosition`: the number of
documents read, every pass and empty document counted, and the tokens of the current one already
packed). A batch stream started at such a position continues exactly where the first one was
(the documents before it are read but not tokenised): that is how a resumed run gets its data.
"""

from __future__ import annotations

import itertools
import json
import os
import queue
import sysconfig
import threading
import tokenize
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Generic, TypeVar

import numpy as np
import torch
from torch import Tensor

TEXT_SUFFIXES = (".txt", ".md", ".rst", ".py")
"""Files of a plain directory corpus that are read as text (besides ``.jsonl``)."""

_INSTALLED_PACKAGE_DIRS = ("site-packages", "dist-packages")
"""Directories below the standard library that hold installed packages, not the library."""

_DATASETS_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")
"""Files ``datasets.save_to_disk`` writes into a dataset (or dataset dict) directory."""


class CorpusError(ValueError):
    """A corpus that cannot be read: a missing path, no documents, a bad JSONL line. One line."""


@dataclass(frozen=True)
class CorpusSource:
    """One source of documents: ``kind`` is ``"text"``, ``"jsonl"``, ``"python"`` (a standard
    library module: its coding cookie is honoured, undecodable test fixtures are skipped) or
    ``"datasets"``."""

    path: Path
    kind: str


@dataclass(frozen=True)
class StreamPosition:
    """A place in the endless document stream of a corpus: ``document`` documents (counted over
    every pass, empty ones included) lie before it, and ``offset`` tokens of the next one are
    already packed."""

    document: int = 0
    offset: int = 0


@dataclass(frozen=True)
class PackedSequence:
    """``seq_len`` tokens of the packed corpus.

    Attributes:
        input_ids: ``[seq_len]`` int64.
        cu_seqlens: ``[k+1]`` int32 starts of the ``k`` document pieces in the sequence, ending
            at ``seq_len``.
        end: where the stream stands after this sequence (``None`` for a sequence made by hand);
            for a batch of :class:`CorpusBatches`, after the last sequence of its last round.
    """

    input_ids: Tensor
    cu_seqlens: Tensor
    end: StreamPosition | None = None


def stdlib_sources() -> list[CorpusSource]:
    """The default corpus: every ``.py`` file of the standard library, sorted (installed
    packages under ``site-packages``/``dist-packages`` excluded)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files: list[Path] = []
    for directory, subdirs, names in os.walk(root):
        subdirs[:] = [d for d in subdirs if d not in _INSTALLED_PACKAGE_DIRS]  # not walked at all
        files.extend(Path(directory) / name for name in names if name.endswith(".py"))
    files.sort()
    if not files:
        raise CorpusError(f"the default corpus is empty: no .py files under {root}; pass --corpus")
    return [CorpusSource(f, "python") for f in files]


def resolve_corpus(paths: Sequence[str | Path] | None) -> list[CorpusSource]:
    """The sources of a corpus given as paths (files or directories); the standard library when
    ``paths`` is empty or ``None``. Checks that every path exists and that directories hold
    documents; reads no document.

    Raises:
        CorpusError: a path is missing, a directory has no readable file, or a ``datasets``
            directory is given without the ``datasets`` package.
    """
    if not paths:
        return stdlib_sources()
    sources: list[CorpusSource] = []
    for given in paths:
        path = Path(given)
        if path.is_file():
            sources.append(CorpusSource(path, "jsonl" if path.suffix == ".jsonl" else "text"))
        elif path.is_dir() and any((path / marker).is_file() for marker in _DATASETS_MARKERS):
            try:
                import datasets  # noqa: F401
            except ImportError:
                raise CorpusError(f"corpus {path} is a datasets directory but the datasets package is not "
                                  "installed: pip install datasets") from None
            sources.append(CorpusSource(path, "datasets"))
        elif path.is_dir():
            found = sorted(f for f in path.rglob("*") if f.is_file() and f.suffix in (*TEXT_SUFFIXES, ".jsonl"))
            if not found:
                raise CorpusError(f"corpus directory {path} has no {', '.join((*TEXT_SUFFIXES, '.jsonl'))} files")
            sources.extend(CorpusSource(f, "jsonl" if f.suffix == ".jsonl" else "text") for f in found)
        else:
            raise CorpusError(f"corpus {path} does not exist")
    return sources


def _jsonl_texts(path: Path) -> Iterator[str]:
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError as err:
                raise CorpusError(f"{path}:{number}: not a JSON line ({err})") from None
            text = record.get("text") if isinstance(record, dict) else None
            if not isinstance(text, str):
                raise CorpusError(f'{path}:{number}: expected an object with a string "text" field')
            yield text


def _datasets_texts(path: Path) -> Iterator[str]:
    import datasets

    loaded = datasets.load_from_disk(str(path))
    splits = [loaded[name] for name in sorted(loaded)] if isinstance(loaded, datasets.DatasetDict) else [loaded]
    for split in splits:
        if "text" not in split.column_names:
            raise CorpusError(f'dataset {path} has no "text" column (columns: {", ".join(split.column_names)})')
        yield from split["text"]


def read_documents(source: CorpusSource) -> Iterator[str]:
    """The documents of one source, in order.

    Raises:
        CorpusError: a user file is not UTF-8, or a JSONL line / dataset lacks ``"text"``.
    """
    if source.kind == "jsonl":
        yield from _jsonl_texts(source.path)
    elif source.kind == "datasets":
        yield from _datasets_texts(source.path)
    elif source.kind == "python":
        try:
            with tokenize.open(source.path) as f:
                text = f.read()
        except (SyntaxError, UnicodeDecodeError):  # the test suite's deliberately broken encodings
            return
        yield text
    else:
        try:
            yield source.path.read_text(encoding="utf-8")
        except UnicodeDecodeError as err:
            raise CorpusError(f"{source.path} is not UTF-8 text ({err.reason} at byte {err.start})") from None


def tokenized_documents(
    sources: Sequence[CorpusSource], encode: Callable[[str], list[int]], eos_id: int, skip: int = 0
) -> Iterator[list[int]]:
    """Every document of ``sources`` as token ids with ``eos_id`` appended (an empty document as
    ``[]``), the corpus repeated without end; the first ``skip`` documents are read but not
    tokenised (each comes as ``[]``).

    Raises:
        CorpusError: a whole pass over the corpus found no text.
    """
    count = 0
    for _ in itertools.count():
        found = False
        for source in sources:
            for text in read_documents(source):
                found = found or bool(text)
                skipped, count = count < skip, count + 1
                ids = encode(text) if text and not skipped else []
                yield [*ids, eos_id] if ids else []
        if not found:
            raise CorpusError(f"the corpus ({len(sources)} sources) has no text to train on")


def pack_documents(documents: Iterable[Sequence[int]], seq_len: int,
                   start: StreamPosition = StreamPosition()) -> Iterator[PackedSequence]:
    """Lay ``documents`` (token ids: lists, or the token cache's arrays) back to back and cut the
    stream into sequences of ``seq_len`` tokens; a document longer than the room left continues in
    the next sequence.

    ``documents`` is the stream from its beginning; packing starts at ``start`` (the documents
    before it are passed over, whatever they hold, and the first ``start.offset`` tokens of the
    next one are left out). Each sequence's ``end`` is the position after it.
    """
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    pieces: list[Sequence[int]] = []
    starts: list[int] = []
    filled = 0
    for index, doc in enumerate(itertools.islice(documents, start.document, None), start.document):
        offset = start.offset if index == start.document else 0
        while offset < len(doc):
            take = min(seq_len - filled, len(doc) - offset)
            starts.append(filled)
            pieces.append(doc[offset: offset + take])
            offset += take
            filled += take
            if filled == seq_len:
                end = StreamPosition(index, offset) if offset < len(doc) else StreamPosition(index + 1, 0)
                ids = np.concatenate([np.asarray(p, dtype=np.int64) for p in pieces])
                yield PackedSequence(torch.from_numpy(ids), torch.tensor([*starts, seq_len], dtype=torch.int32), end)
                pieces, starts, filled = [], [], 0


def concat_sequences(sequences: Sequence[PackedSequence]) -> PackedSequence:
    """Several packed sequences as one packed batch (``[sum of lengths]`` ids, joint boundaries)."""
    ids = torch.cat([s.input_ids for s in sequences])
    bounds, offset = [torch.zeros(1, dtype=torch.int32)], 0
    for s in sequences:
        bounds.append(s.cu_seqlens[1:] + offset)
        offset += s.input_ids.numel()
    return PackedSequence(ids, torch.cat(bounds))


def _encoder(tokenizer: Any) -> Callable[[str], list[int]]:
    """A Hugging Face tokenizer as a text -> token ids function (no special tokens added)."""

    def encode(text: str) -> list[int]:
        return list(tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"])

    return encode


def held_out_sequences(sources: Sequence[CorpusSource], tokenizer: Any, *, eos_id: int, seq_len: int,
                       dp_size: int, dp_rank: int) -> list[PackedSequence]:
    """An evaluation set: one pass over ``sources`` packed like the training corpus (the tail that
    does not fill a sequence is left out), cut to a multiple of ``dp_size`` sequences; replica
    ``dp_rank`` gets every ``dp_size``-th of them.

    Raises:
        CorpusError: the corpus gives fewer than ``dp_size`` sequences of ``seq_len`` tokens.
    """
    encode = _encoder(tokenizer)
    docs = ([*ids, eos_id] if (ids := encode(text) if text else []) else []
            for source in sources for text in read_documents(source))
    packed = list(pack_documents(docs, seq_len))
    if len(packed) < dp_size:
        raise CorpusError(f"the evaluation corpus fills {len(packed)} sequences of {seq_len} tokens; "
                          f"{dp_size} (one per data-parallel replica) are needed")
    return packed[: len(packed) - len(packed) % dp_size][dp_rank::dp_size]


class CorpusBatches:
    """Micro-batches of one data-parallel replica: ``micro_batch`` packed sequences of ``seq_len``
    tokens each, joined into one packed batch (:func:`concat_sequences`), without end.

    Args:
        sources: from :func:`resolve_corpus`.
        tokenizer: a Hugging Face tokenizer (called as ``tokenizer(text, ...)["input_ids"]``, no
            special tokens added).
        eos_id: the token appended to every document.
        seq_len: tokens per sequence.
        micro_batch: sequences per micro-batch (DeepSpeed's ``train_micro_batch_size_per_gpu``).
        dp_size, dp_rank: replica ``dp_rank`` takes every ``dp_size``-th sequence: the stream is
            read in rounds of ``dp_size`` sequences, one for each replica, so the ``end`` of every
            replica's n-th batch is the same position.
        start: where the stream starts (a batch's ``end``: the batches that followed it).
        documents: the tokenised document stream from its beginning with the first
            ``start.document`` documents passed over (:meth:`megacp.train.token_cache.TokenCache.stream`),
            instead of tokenising ``sources`` here.
    """

    def __init__(self, sources: Sequence[CorpusSource], tokenizer: Any, *, eos_id: int, seq_len: int,
                 micro_batch: int, dp_size: int, dp_rank: int, start: StreamPosition = StreamPosition(),
                 documents: Iterator[Sequence[int]] | None = None) -> None:
        if micro_batch < 1:
            raise ValueError(f"micro_batch must be >= 1, got {micro_batch}")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank must be in [0, {dp_size}), got {dp_rank}")

        docs = documents if documents is not None else tokenized_documents(
            sources, _encoder(tokenizer), eos_id, skip=start.document)
        self._sequences = pack_documents(docs, seq_len, start)
        self.micro_batch, self.dp_size, self.dp_rank = micro_batch, dp_size, dp_rank

    def __iter__(self) -> Iterator[PackedSequence]:
        return self

    def __next__(self) -> PackedSequence:
        picked = []
        for _ in range(self.micro_batch):
            round_ = [next(self._sequences) for _ in range(self.dp_size)]
            picked.append(round_[self.dp_rank])
        return replace(concat_sequences(picked), end=round_[-1].end)


T = TypeVar("T")
_END = object()
"""Put by :class:`Prefetcher`'s thread after the last item."""


class Prefetcher(Generic[T]):
    """The items of ``source``, produced up to ``depth`` ahead on a background thread.

    Reading and tokenising the next sequences then overlaps the training step (the GPU kernels and
    the host's waits on them) instead of adding to it. Items come out in order; an exception of
    ``source`` (a bad JSONL line, say) is raised by the ``next`` call that reaches it. Use as a
    context manager (or call :meth:`close`): the thread stops at its next item.
    """

    def __init__(self, source: Iterator[T], depth: int = 4) -> None:
        if depth < 1:
            raise ValueError(f"depth must be >= 1, got {depth}")
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._fill, args=(source,), name="megacp-prefetch", daemon=True)
        self._thread.start()

    def _put(self, item: Any) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _fill(self, source: Iterator[T]) -> None:
        try:
            for item in source:
                if not self._put((item, None)):
                    return
            self._put((_END, None))
        except Exception as exc:  # noqa: BLE001 - handed to the consumer, raised there
            self._put((None, exc))

    def __iter__(self) -> Prefetcher[T]:
        return self

    def __next__(self) -> T:
        item, exc = self._queue.get()
        if exc is not None:
            self._queue.put((None, exc))  # every later call raises it too
            raise exc
        if item is _END:
            self._queue.put((_END, None))
            raise StopIteration
        return item

    def close(self) -> None:
        """Stop the thread (it finishes the item it is producing) and wait for it."""
        self._stop.set()
        self._thread.join()

    def __enter__(self) -> Prefetcher[T]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
