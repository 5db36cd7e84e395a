"""Token corpora: preparation, memmap access, sample addressing, errors."""

from __future__ import annotations

import json

import numpy as np
import pytest

from resilient.gpt.data import TokenCorpus, ensure_corpus, prepare
from resilient.errors import DataError


@pytest.fixture
def text_corpus(tmp_path):
    src = tmp_path / "text"
    src.mkdir()
    (src / "a.txt").write_text("hello world\n" * 500)
    (src / "b.txt").write_text("résumé ünïcode\n" * 300)
    return prepare(str(src), tmp_path / "corpus")


def test_prepare_is_byte_level(text_corpus, tmp_path):
    meta = json.loads((text_corpus / "meta.json").read_text())
    assert meta["vocab_size"] == 256 and meta["dtype"] == "uint16"
    tokens = np.fromfile(text_corpus / "tokens.bin", dtype="<u2")
    assert len(tokens) == meta["n_tokens"]
    assert bytes(tokens[:12].astype(np.uint8)) == b"hello world\n"


def test_samples_do_not_depend_on_dp(text_corpus):
    c = TokenCorpus(text_corpus, seq_len=16, seed=7)
    whole = c.batch(step=3, global_batch=8, dp_rank=0, dp=1)
    halves = [c.batch(step=3, global_batch=8, dp_rank=r, dp=2) for r in range(2)]
    assert (whole.inputs[:4] == halves[0].inputs).all() and (whole.inputs[4:] == halves[1].inputs).all()
    assert (whole.targets[:, :-1] == whole.inputs[:, 1:]).all()


def test_order_is_seeded_and_epochs_differ(text_corpus):
    a = TokenCorpus(text_corpus, seq_len=16, seed=1)
    b = TokenCorpus(text_corpus, seq_len=16, seed=1)
    c = TokenCorpus(text_corpus, seq_len=16, seed=2)
    assert (a.sample(5) == b.sample(5)).all()
    assert any((a.sample(i) != c.sample(i)).any() for i in range(10))
    n = a.n_samples
    assert sorted(tuple(a.sample(i)) for i in range(n)) == sorted(tuple(a.sample(n + i)) for i in range(n))


def test_missing_corpus_says_how_to_build(tmp_path):
    with pytest.raises(DataError, match="resilient data prepare"):
        ensure_corpus(str(tmp_path / "none"), source="")
    with pytest.raises(DataError, match="meta.json missing"):
        TokenCorpus(tmp_path, seq_len=8, seed=0)


def test_missing_corpus_is_built_from_source(tmp_path):
    src = tmp_path / "t.txt"
    src.write_text("abc " * 1000)
    p = ensure_corpus(str(tmp_path / "c"), source=str(src))
    assert TokenCorpus(p, seq_len=8, seed=0).n_samples > 10


def test_truncated_corpus(text_corpus):
    with open(text_corpus / "tokens.bin", "r+b") as f:
        f.truncate(100)
    with pytest.raises(DataError, match="truncated"):
        TokenCorpus(text_corpus, seq_len=8, seed=0)


def test_vocab_that_does_not_fit_the_model(text_corpus):
    c = TokenCorpus(text_corpus, seq_len=8, seed=0)
    with pytest.raises(DataError, match="model.vocab_size ≥ 256"):
        c.check_vocab(128, "run.toml")


def test_stdlib_corpus_prepares_without_download(tmp_path):
    p = prepare("python-stdlib", tmp_path / "std", max_bytes=50_000)
    assert json.loads((p / "meta.json").read_text())["n_tokens"] == 50_000


def _leftovers(folder):
    return sorted(p.name for p in folder.rglob("*tmp*"))


def test_out_inside_source_reads_only_the_source(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    text = b"some text\n" * 1000
    (src / "a.txt").write_bytes(text)
    for _ in range(2):  # the second run must not read the first run's tokens.bin or meta.json
        out = prepare(str(src), src / "corpus")
        meta = json.loads((out / "meta.json").read_text())
        assert meta["n_tokens"] == len(text) + 2
        assert bytes(np.fromfile(out / "tokens.bin", dtype="<u2").astype(np.uint8)) == text + b"\n\n"
    assert _leftovers(src) == []


def test_out_equal_to_source_is_refused(tmp_path):
    (tmp_path / "a.txt").write_text("abc " * 100)
    with pytest.raises(DataError, match="outside the source"):
        prepare(str(tmp_path), tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt"]


def test_missing_source_creates_nothing(tmp_path):
    with pytest.raises(DataError, match="neither 'python-stdlib' nor an existing"):
        prepare(str(tmp_path / "nonexistent"), tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_interrupted_prepare_leaves_no_temp_file(tmp_path, monkeypatch):
    src = tmp_path / "src"
    src.mkdir()
    for name in ("a.txt", "b.txt"):
        (src / name).write_text("abc " * 100)
    real = type(src).read_bytes

    def read_bytes(self):
        if self.name == "b.txt":
            raise KeyboardInterrupt  # Ctrl-C halfway through the files
        return real(self)

    monkeypatch.setattr(type(src), "read_bytes", read_bytes)
    with pytest.raises(KeyboardInterrupt):
        prepare(str(src), tmp_path / "out")
    assert list((tmp_path / "out").iterdir()) == []


def test_out_that_is_a_file(tmp_path):
    (tmp_path / "a.txt").write_text("abc " * 100)
    (tmp_path / "f").write_text("")
    with pytest.raises(DataError, match="exists and is not a folder; choose another OUT"):
        prepare(str(tmp_path / "a.txt"), tmp_path / "f")
    with pytest.raises(DataError, match="cannot create the corpus folder .*Not a directory"):
        prepare(str(tmp_path / "a.txt"), tmp_path / "f" / "sub")


def test_read_only_out_is_a_data_error_and_cleans_up(tmp_path, monkeypatch):
    import errno
    import os

    (tmp_path / "a.txt").write_text("abc " * 100)

    def replace(a, b):  # tests run as root, so chmod cannot make a folder read-only
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(b))

    monkeypatch.setattr("resilient.gpt.data.os.replace", replace)
    with pytest.raises(DataError, match="cannot write the corpus in .*Read-only file system.*writable"):
        prepare(str(tmp_path / "a.txt"), tmp_path / "out")
    assert list((tmp_path / "out").iterdir()) == []


def test_negative_max_bytes_is_refused(tmp_path):
    (tmp_path / "a.txt").write_text("abc " * 100)
    with pytest.raises(DataError, match="max bytes -5 is negative.*--max-bytes"):
        prepare(str(tmp_path / "a.txt"), tmp_path / "out", max_bytes=-5)
    assert not (tmp_path / "out").exists()
