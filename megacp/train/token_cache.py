"""The tokenised corpus, cached on disk: every document's token ids (EOS appended) in one
memory-mapped file, so a second run on the same corpus with the same tokenizer reads tokens instead
of tokenising, and the training loop's host work per step is a slice of an array.

Layout of a cache directory ``<root>/<key>/``: ``tokens.npy`` (uint32, all documents back to back),
``offsets.npy`` (int64, ``[documents + 1]`` starts; an empty document has two equal offsets) and
``meta.json`` (counts, the tokenizer and sources it was made from, and the SHA-256 of the two array
files: a cache whose files changed since, were cut short or went missing is made again). The key is a SHA-256 of the
tokenizer's full definition, the EOS id and the bytes of every source file, so a changed corpus or
tokenizer makes a new cache. A cache is written into a temporary directory beside its final place
and renamed there when complete: a killed run leaves no half cache, and two runs building the same
cache at once both end with a complete one.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from megacp.train.data import CorpusError, CorpusSource, read_documents

BATCH_DOCUMENTS = 256
"""Documents handed to the tokenizer at once (a fast tokenizer encodes a batch in parallel)."""


def default_root() -> Path:
    """``$MEGACP_CACHE_DIR/tokens``, else ``~/.cache/megacp/tokens``."""
    base = os.environ.get("MEGACP_CACHE_DIR")
    return (Path(base) if base else Path.home() / ".cache" / "megacp") / "tokens"


def _tokenizer_fingerprint(tokenizer: Any) -> bytes:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:  # a fast tokenizer: its whole definition as JSON
        return backend.to_str().encode()
    vocab = sorted(tokenizer.get_vocab().items())
    return f"{type(tokenizer).__name__}:{vocab!r}".encode()


def _source_files(source: CorpusSource) -> list[Path]:
    if source.path.is_dir():
        return sorted(p for p in source.path.rglob("*") if p.is_file())
    return [source.path]


def corpus_key(sources: Sequence[CorpusSource], tokenizer: Any, eos_id: int) -> str:
    """The cache key of ``sources`` tokenised by ``tokenizer`` with ``eos_id`` (hex SHA-256)."""
    h = hashlib.sha256(_tokenizer_fingerprint(tokenizer))
    h.update(f"eos={eos_id}".encode())
    for source in sources:
        h.update(f"\0{source.kind}\0".encode())
        for path in _source_files(source):
            h.update(str(path.relative_to(source.path) if path != source.path else path.name).encode())
            with open(path, "rb") as f:
                for block in iter(lambda: f.read(1 << 20), b""):
                    h.update(block)
    return h.hexdigest()


@dataclass(frozen=True)
class TokenCache:
    """A tokenised corpus on disk (see the module docstring).

    Attributes:
        path: its directory; tokens: ``[total]`` uint32 (memory-mapped); offsets: ``[documents + 1]``.
        reused: it existed before this run (nothing was tokenised).
        seconds: time spent tokenising (0 when reused).
        rebuilt: a cache was there but did not match its recorded digest, so it was made again.
    """

    path: Path
    tokens: np.ndarray
    offsets: np.ndarray
    reused: bool
    seconds: float
    rebuilt: bool = False

    @property
    def documents(self) -> int:
        return len(self.offsets) - 1

    def describe(self) -> str:
        what = "reused the tokenised corpus" if self.reused else f"tokenised the corpus in {self.seconds:.1f} s"
        if self.rebuilt:
            what += " (the cached copy did not match its recorded digest: made again)"
        return f"{what}: {self.documents} documents, {len(self.tokens):,} tokens ({self.path})"

    def stream(self, skip: int = 0) -> Iterator[np.ndarray]:
        """Every document's token ids (EOS included; an empty document empty), the corpus repeated
        without end, as :func:`~megacp.train.data.tokenized_documents` gives them but as views of
        the memory-mapped file (``[n]`` uint32; nothing is converted to Python ints); the first
        ``skip`` documents come empty (they are passed over, not read)."""
        if len(self.tokens) == 0:
            raise CorpusError(f"the corpus ({self.path}) has no text to train on")
        count = 0
        while True:
            for i in range(self.documents):
                skipped, count = count < skip, count + 1
                yield self.tokens[:0] if skipped else self.tokens[self.offsets[i]:self.offsets[i + 1]]


def _files_digest(path: Path) -> str:
    """SHA-256 of the cache's ``tokens.npy`` and ``offsets.npy`` bytes (read in 8 MiB pieces)."""
    h = hashlib.sha256()
    for name in ("tokens.npy", "offsets.npy"):
        with open(path / name, "rb") as f:
            while piece := f.read(8 << 20):
                h.update(piece)
    return h.hexdigest()


def _intact(path: Path) -> bool:
    """Whether the cache at ``path`` holds what was written (its files' digest is the one ``meta.json``
    recorded); a file changed, truncated or missing since, or a cache without a recorded digest, is not."""
    try:
        meta = json.loads((path / "meta.json").read_text(encoding="utf-8"))
        return isinstance(meta, dict) and meta.get("sha256") == _files_digest(path)
    except (OSError, ValueError):
        return False


def _open(path: Path, reused: bool, seconds: float, rebuilt: bool = False) -> TokenCache:
    return TokenCache(path, np.load(path / "tokens.npy", mmap_mode="r"), np.load(path / "offsets.npy"), reused, seconds,
                      rebuilt)


def build_token_cache(sources: Sequence[CorpusSource], tokenizer: Any, *, eos_id: int,
                      root: Path | None = None) -> TokenCache:
    """The cache of ``sources`` under ``root`` (default :func:`default_root`): opened when it exists,
    else made by one pass of the tokenizer over the corpus (in batches of :data:`BATCH_DOCUMENTS`).

    Raises:
        CorpusError: a source cannot be read (as :func:`~megacp.train.data.read_documents`), or the
            cache directory cannot be written.
    """
    root = root or default_root()
    path = root / corpus_key(sources, tokenizer, eos_id)
    rebuilt = path.exists()
    if (path / "meta.json").is_file() and _intact(path):
        return _open(path, True, 0.0)
    if rebuilt:  # changed, truncated or half-gone since it was made: made again
        shutil.rmtree(path, ignore_errors=True)
    start = time.perf_counter()
    try:
        root.mkdir(parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(prefix=f".{path.name[:16]}.", dir=root))
    except OSError as err:
        raise CorpusError(f"cannot write the token cache under {root}: {err.strerror or err}") from None
    try:
        lengths: list[int] = []
        chunks: list[np.ndarray] = []
        batch: list[str] = []

        def flush() -> None:
            encoded = tokenizer(batch, add_special_tokens=False, verbose=False)["input_ids"] if batch else []
            for text, ids in zip(batch, encoded):
                ids = [*ids, eos_id] if text and ids else []
                lengths.append(len(ids))
                chunks.append(np.asarray(ids, dtype=np.uint32))
            batch.clear()

        for source in sources:
            for text in read_documents(source):
                batch.append(text)
                if len(batch) == BATCH_DOCUMENTS:
                    flush()
        flush()
        tokens = np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.uint32)
        offsets = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)])
        np.save(work / "tokens.npy", tokens)
        np.save(work / "offsets.npy", offsets)
        meta = {"documents": len(lengths), "tokens": int(tokens.size), "eos_id": eos_id, "sha256": _files_digest(work),
                "tokenizer": getattr(tokenizer, "name_or_path", type(tokenizer).__name__),
                "sources": [str(s.path) for s in sources]}
        (work / "meta.json").write_text(json.dumps(meta, indent=1), encoding="utf-8")
        try:
            os.replace(work, path)
        except OSError:  # another run finished the same cache first: keep theirs
            if not (path / "meta.json").is_file():
                raise
    except OSError as err:
        raise CorpusError(f"cannot write the token cache {path}: {err.strerror or err}") from None
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return _open(path, False, time.perf_counter() - start, rebuilt)
