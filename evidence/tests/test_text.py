"""The byte-level text corpus: file listing, the split by path hash, corpus_info, the training
windows by (seed, step) and the evaluation windows."""

import os

import numpy as np
import pytest

from evidence.tasks import IGNORE
from evidence.tasks.text import (SEPARATOR, TrainWindows, corpus_files, eval_windows, is_held_out, load_corpus,
                                 stdlib_root)


def write_corpus(root, n_files=100):
    """``n_files`` small .py files under ``root`` (some in a package), plus files that must be skipped."""
    for i in range(n_files):
        folder = os.path.join(root, "pkg") if i % 3 else root
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, f"m{i}.py"), "w") as fh:
            body = "".join(f"def f{j}(x):\n    return x * {(7 * i + j) % 97}\n" for j in range(3))
            fh.write(f"# module {i}\n{body}")
    for skipped in ("site-packages", os.path.join("pkg", "dist-packages")):
        os.makedirs(os.path.join(root, skipped), exist_ok=True)
        with open(os.path.join(root, skipped, "third.py"), "w") as fh:
            fh.write("x = 1\n")
    with open(os.path.join(root, "notes.txt"), "w") as fh:
        fh.write("not python\n")
    return root


@pytest.fixture(scope="module")
def corpus_root(tmp_path_factory):
    return write_corpus(str(tmp_path_factory.mktemp("corpus")))


def test_files_sorted_relative_and_without_third_party(corpus_root):
    files = corpus_files(corpus_root)
    assert files == sorted(files) and len(files) == 100
    assert "m0.py" in files and "pkg/m1.py" in files
    assert not any("packages" in f or not f.endswith(".py") for f in files)
    with pytest.raises(ValueError, match="root"):
        corpus_files(os.path.join(corpus_root, "missing"))


def test_stdlib_corpus_is_the_standard_library_only():
    files = corpus_files(stdlib_root())
    assert "os.py" in files and "json/__init__.py" in files
    assert not any(part in ("site-packages", "dist-packages") for f in files for part in f.split("/"))


def test_split_is_by_file_stable_and_about_five_percent(corpus_root):
    paths = [f"lib/mod{i}.py" for i in range(4000)]
    held = [is_held_out(p) for p in paths]
    assert held == [is_held_out(p) for p in paths]            # a pure function of the path
    assert 0.03 < np.mean(held) < 0.07
    corpus = load_corpus(corpus_root)
    train, test = corpus.train.tobytes(), corpus.test.tobytes()
    for path in corpus_files(corpus_root):
        with open(os.path.join(corpus_root, path), "rb") as fh:
            text = fh.read() + bytes([SEPARATOR])
        # every file's bytes in exactly one split (the files are distinct)
        assert (text in test) == is_held_out(path) and (text in train) != is_held_out(path)


def test_corpus_info_records_sizes_and_file_list(corpus_root, tmp_path):
    corpus = load_corpus(corpus_root)
    info = corpus.info
    assert info["files"]["train"] + info["files"]["test"] == 100 and info["files"]["test"] > 0
    assert info["bytes"] == {"train": corpus.train.size, "test": corpus.test.size}
    assert corpus.train.dtype == np.uint8 and info["python"].count(".") == 2
    assert len(info["file_list_sha256"]) == 64
    assert load_corpus(corpus_root).info == info                      # reproducible
    other = write_corpus(str(tmp_path), n_files=101)
    assert load_corpus(other).info["file_list_sha256"] != info["file_list_sha256"]


def test_empty_split_is_refused(tmp_path):
    write_corpus(str(tmp_path), n_files=2)
    with pytest.raises(ValueError, match="split has no files"):
        load_corpus(str(tmp_path))


def test_train_windows_depend_on_seed_and_step_only():
    data = np.random.default_rng(0).integers(0, 256, 5000, dtype=np.uint8)
    a, b = TrainWindows(data, 3, 4, 63), TrainWindows(data, 3, 4, 63)
    assert a.at(7).shape == (4, 64) and a.at(7).dtype == np.uint8
    a.at(1)
    np.testing.assert_array_equal(a.at(7), b.at(7))                  # whatever was drawn before
    assert not np.array_equal(a.at(7), a.at(8))
    assert not np.array_equal(a.at(7), TrainWindows(data, 4, 4, 63).at(7))
    row = a.at(7)[0]
    starts = [i for i in range(data.size - 63) if np.array_equal(data[i:i + 64], row)]
    assert starts                                                    # a contiguous slice of the data
    with pytest.raises(ValueError, match="seq_len"):
        TrainWindows(data[:10], 0, 1, 63)


@pytest.mark.parametrize("size", [2, 64, 1000])
def test_eval_windows_score_every_byte_once(size):
    data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
    x, y = eval_windows(data, 63)
    assert x.shape == y.shape and x.shape[1] == 63 and x.dtype == np.int64
    scored = y[y != IGNORE]
    np.testing.assert_array_equal(scored, data[1:])
    np.testing.assert_array_equal(x.reshape(-1)[: size - 1], data[:-1])
    assert (y == IGNORE).sum() == x.size - (size - 1)


def test_eval_windows_subset_is_fixed_and_spread():
    data = np.random.default_rng(1).integers(0, 256, 100 * 32 + 1, dtype=np.uint8)
    x_all, _ = eval_windows(data, 32)
    x, y = eval_windows(data, 32, max_bytes=10 * 32)
    assert x.shape == (10, 32)
    np.testing.assert_array_equal(x[0], x_all[0])
    np.testing.assert_array_equal(x[-1], x_all[-1])
    np.testing.assert_array_equal(eval_windows(data, 32, max_bytes=320)[1], y)
    with pytest.raises(ValueError, match="2 bytes"):
        eval_windows(data[:1], 32)
