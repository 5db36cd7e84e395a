"""Token corpora: flat binary files of token ids, addressed by global sample index.

A corpus directory holds::

    tokens.bin   token ids, little-endian uint16 (vocabulary ≤ 65536) or uint32
    meta.json    {"format": 1, "dtype": "uint16", "vocab_size": 256,
                  "n_tokens": N, "tokenizer": "bytes", "source": "...", "sha256": "..."}

It is read through ``numpy.memmap`` and never loaded whole. Sample ``g`` of an
epoch is ``seq_len + 1`` consecutive tokens starting at a position chosen by a
permutation seeded by (seed, epoch), so the samples a step sees depend only on
the step and the global batch, never on how many data-parallel ranks share it:
step ``s`` consumes global samples ``[s·G, (s+1)·G)`` and dp rank ``r`` of
``dp`` reads only its slice ``[s·G + r·G/dp, s·G + (r+1)·G/dp)``. The data
position of a run is therefore one integer, the next global sample index.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from resilient.errors import DataError

FORMAT = 1
BYTE_VOCAB = 256


def _stdlib_files() -> list[Path]:
    """The pure-Python standard library's sources: text that ships with Python."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__"}
    files = [p for p in root.rglob("*.py") if not skip.intersection(p.relative_to(root).parts)]
    return sorted(files)


def _text_files(source: str, out: Path) -> list[Path]:
    """The files to read, listed before ``out`` gets anything written into it.

    Files under ``out`` are left out: with OUT inside SRC, ``prepare`` would
    otherwise read its own half-written temp file, or an earlier corpus."""
    if source == "python-stdlib":
        return _stdlib_files()
    src = Path(source).expanduser()
    if src.is_file():
        return [src]
    if src.is_dir():
        src_r, out_r = src.resolve(), out.resolve()
        if src_r == out_r or src_r.is_relative_to(out_r):
            raise DataError(
                f"corpus folder {out} is the source folder {source!r} or holds it; "
                f"write the corpus to a folder outside the source, e.g. {src_r.parent / (src_r.name + '-corpus')}"
            )
        return sorted(p for p in src.rglob("*") if p.is_file() and not p.resolve().is_relative_to(out_r))
    raise DataError(
        f"corpus source {source!r} is neither 'python-stdlib' nor an existing file or folder"
    )


def _make_out_dir(out: Path) -> None:
    try:
        out.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise DataError(f"corpus folder {out} exists and is not a folder; choose another OUT path") from None
    except OSError as e:
        raise DataError(
            f"cannot create the corpus folder {out}: {e.strerror or e}; "
            f"choose an OUT path you can write, on a writable filesystem, under existing folders"
        ) from None


def _write_tokens(files: list[Path], tmp: Path, max_bytes: int) -> tuple[int, str]:
    """Write the byte tokens of ``files`` to ``tmp``; (tokens written, sha256 of the text)."""
    digest = hashlib.sha256()
    n = 0
    with open(tmp, "wb") as f:
        for path in files:
            try:
                data = path.read_bytes() + b"\n\n"
            except OSError as e:
                raise DataError(
                    f"cannot read corpus source file {path}: {e.strerror or e}; "
                    f"fix its permissions or remove it from the source"
                ) from None
            if max_bytes and n + len(data) > max_bytes:
                data = data[: max_bytes - n]
            arr = np.frombuffer(data, dtype=np.uint8).astype("<u2")
            f.write(arr.tobytes())
            digest.update(data)
            n += len(data)
            if max_bytes and n >= max_bytes:
                break
    return n, digest.hexdigest()


def prepare(source: str, out: str | os.PathLike, max_bytes: int = 0) -> Path:
    """Build a byte-level corpus at ``out`` from text at ``source``.

    The byte-level tokenizer maps each byte to its value (vocabulary 256). The
    corpus appears atomically: files are written under a temporary name and
    renamed, and the temporary files are removed on any failure (Ctrl-C too),
    so a killed ``prepare`` never leaves a half corpus or a stray file behind.
    """
    if max_bytes < 0:
        raise DataError(
            f"max bytes {max_bytes} is negative; pass --max-bytes N (or 'data.max_bytes') "
            f"with N ≥ 0, where 0 reads all the text"
        )
    out = Path(out).expanduser()
    files = _text_files(source, out)
    if not files:
        raise DataError(f"corpus source {source!r} holds no text")
    _make_out_dir(out)
    tmp = out / f"tokens.bin.tmp{os.getpid()}"
    meta_tmp = out / f"meta.json.tmp{os.getpid()}"
    try:
        n, sha = _write_tokens(files, tmp, max_bytes)
        if n < 2:
            raise DataError(f"corpus source {source!r} holds no text")
        meta = {"format": FORMAT, "dtype": "uint16", "vocab_size": BYTE_VOCAB, "n_tokens": n,
                "tokenizer": "bytes", "source": source, "sha256": sha}
        meta_tmp.write_text(json.dumps(meta, indent=1))
        # An old meta.json goes first: between the two renames a reader then sees
        # "no corpus", never the new tokens described by the old meta.
        (out / "meta.json").unlink(missing_ok=True)
        os.replace(tmp, out / "tokens.bin")
        os.replace(meta_tmp, out / "meta.json")
    except OSError as e:
        raise DataError(
            f"cannot write the corpus in {out}: {e.strerror or e}; "
            f"choose an OUT folder on a writable filesystem with room for ~2 bytes per byte of text"
        ) from None
    finally:
        for leftover in (tmp, meta_tmp):
            try:
                leftover.unlink(missing_ok=True)
            except OSError:
                pass  # the write error (or Ctrl-C) being raised is the one to report
    return out


def check_corpus(path: str, source: str) -> None:
    """Raise :class:`DataError` if a run could neither find nor build its corpus
    (the launcher asks before it starts anything; a worker would fail at start-up)."""
    if not path:
        raise DataError("no corpus: set 'data.path' to a folder made by `resilient data prepare`")
    p = Path(path).expanduser()
    if not source and not (p / "meta.json").exists():
        raise DataError(
            f"no corpus at {p} (meta.json missing): run `resilient data prepare SRC {p}` "
            f"or set 'data.source' so the run builds it"
        )


def ensure_corpus(path: str, source: str, max_bytes: int = 0) -> Path:
    """The corpus at ``path``, prepared from ``source`` first if it is missing."""
    check_corpus(path, source)
    p = Path(path).expanduser()
    if not (p / "meta.json").exists():
        prepare(source, p, max_bytes)
    return p


@dataclass
class Batch:
    inputs: torch.Tensor   # (b, T) int64
    targets: torch.Tensor  # (b, T) int64, inputs shifted by one


class TokenCorpus:
    """A memory-mapped corpus split into train and validation regions."""

    def __init__(self, path: str | os.PathLike, seq_len: int, seed: int, val_fraction: float = 0.05):
        self.path = Path(path).expanduser()
        meta_path = self.path / "meta.json"
        try:
            self.meta = json.loads(meta_path.read_text())
        except FileNotFoundError:
            raise DataError(f"no corpus at {self.path}: meta.json missing; run `resilient data prepare`") from None
        except json.JSONDecodeError as e:
            raise DataError(f"{meta_path} is not valid JSON ({e}); prepare the corpus again") from None
        if self.meta.get("format") != FORMAT:
            raise DataError(f"{meta_path}: corpus format {self.meta.get('format')!r} is not {FORMAT}; prepare it again")
        dtype = np.dtype(self.meta["dtype"]).newbyteorder("<")
        tokens_path = self.path / "tokens.bin"
        expected = self.meta["n_tokens"] * dtype.itemsize
        actual = tokens_path.stat().st_size if tokens_path.exists() else -1
        if actual != expected:
            raise DataError(
                f"{tokens_path} holds {actual} bytes, meta.json promises {expected}: the corpus "
                f"is truncated or missing; prepare it again"
            )
        self.tokens = np.memmap(tokens_path, dtype=dtype, mode="r")
        self.vocab_size = int(self.meta["vocab_size"])
        self.seq_len = seq_len
        self.seed = seed
        n_val = int(len(self.tokens) * val_fraction)
        self.n_train_tokens = len(self.tokens) - n_val
        self.n_samples = (self.n_train_tokens - 1) // seq_len
        self.n_val_samples = max(0, (n_val - 1) // seq_len)
        if self.n_samples < 1:
            raise DataError(f"corpus {self.path} has {len(self.tokens)} tokens: too few for seq_len {seq_len}")
        self._perm_epoch = -1
        self._perm: np.ndarray | None = None

    def check_vocab(self, model_vocab: int, source: str = "config") -> None:
        if self.vocab_size > model_vocab:
            raise DataError(
                f"corpus {self.path} uses a vocabulary of {self.vocab_size} tokens but "
                f"'model.vocab_size' in {source} is {model_vocab}; set model.vocab_size ≥ {self.vocab_size}"
            )

    def _permutation(self, epoch: int) -> np.ndarray:
        if epoch != self._perm_epoch:
            rng = np.random.Generator(np.random.PCG64([self.seed, epoch]))
            self._perm = rng.permutation(self.n_samples)
            self._perm_epoch = epoch
        return self._perm

    def _window(self, start: int) -> np.ndarray:
        return np.asarray(self.tokens[start : start + self.seq_len + 1], dtype=np.int64)

    def sample(self, g: int) -> np.ndarray:
        """Global training sample ``g`` (seq_len + 1 tokens)."""
        epoch, i = divmod(g, self.n_samples)
        return self._window(int(self._permutation(epoch)[i]) * self.seq_len)

    def _stack(self, rows: list[np.ndarray]) -> Batch:
        arr = torch.from_numpy(np.stack(rows))
        return Batch(arr[:, :-1].contiguous(), arr[:, 1:].contiguous())

    def batch(self, step: int, global_batch: int, dp_rank: int, dp: int) -> Batch:
        """This dp rank's slice of step ``step``'s global batch."""
        per = global_batch // dp
        first = step * global_batch + dp_rank * per
        return self._stack([self.sample(g) for g in range(first, first + per)])

    def val_batch(self, index: int, global_batch: int, dp_rank: int, dp: int) -> Batch:
        """Validation batch ``index`` (fixed, sequential windows of the held-out tail)."""
        if self.n_val_samples < 1:
            raise DataError(f"corpus {self.path} has no validation tokens; raise data.val_fraction")
        per = global_batch // dp
        first = index * global_batch + dp_rank * per
        starts = [self.n_train_tokens + (g % self.n_val_samples) * self.seq_len for g in range(first, first + per)]
        return self._stack([self._window(s) for s in starts])


def main_prepare(argv: list[str]) -> int:
    """``resilient data prepare SRC OUT [--max-bytes N]``."""
    import argparse

    ap = argparse.ArgumentParser(prog="resilient data prepare", description="Build a byte-level token corpus.")
    ap.add_argument("source", help="'python-stdlib', a text file, or a folder of text files")
    ap.add_argument("out", help="corpus folder to write")
    ap.add_argument("--max-bytes", type=int, default=0, help="stop after this many bytes of text")
    args = ap.parse_args(argv)
    out = prepare(args.source, args.out, args.max_bytes)
    meta = json.loads((out / "meta.json").read_text())
    print(f"wrote {out}: {meta['n_tokens']:,} tokens, vocabulary {meta['vocab_size']}", file=sys.stderr)
    return 0
