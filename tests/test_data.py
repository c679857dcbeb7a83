"""data/: vocabulary, obtaining and preparing tiny_shakespeare, and random batches."""

import hashlib
import io
import os
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from corpus import NO_REAL_DATA, REAL_INPUT
from data import (SHA256, Batches, CharVocab, DataError, PreparedData, UnknownCharacterError, prepare,
                  prepare_shakespeare, prepare_text)


SMALL_TEXT = "First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n" * 20


def write_source(path: Path, text: str) -> str:
    """Write `text` to `path` and return the file's sha256."""
    path.write_text(text, encoding="utf-8")
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def small_source(tmp_path):
    """A small text served through a file:// URL: (url, sha256)."""
    path = tmp_path / "source" / "input.txt"
    path.parent.mkdir()
    return path.as_uri(), write_source(path, SMALL_TEXT)


def file_states(root: Path) -> dict:
    """Identity and modification time of every file in root: a rewrite (temp file + rename) changes both."""
    return {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in root.iterdir()}


# --- vocabulary ---------------------------------------------------------------------------------------------------

def test_encode_decode_round_trip():
    vocab = CharVocab.from_text(SMALL_TEXT)
    assert vocab.chars == "".join(sorted(set(SMALL_TEXT)))
    assert len(vocab) == len(set(SMALL_TEXT))
    ids = vocab.encode(SMALL_TEXT)
    assert ids[:3] == [vocab.chars.index(c) for c in "Fir"]
    assert vocab.decode(ids) == SMALL_TEXT
    assert vocab.decode(torch.tensor(ids[:20])) == SMALL_TEXT[:20]
    assert CharVocab(vocab.chars) == vocab  # what checkpoints store rebuilds the same vocabulary


def test_unknown_character_is_rejected_and_named():
    vocab = CharVocab.from_text(SMALL_TEXT)
    with pytest.raises(UnknownCharacterError) as caught:
        vocab.encode("Speak,\tcafé speak")
    assert isinstance(caught.value, DataError)
    assert caught.value.chars == ["\t", "é"]
    message = str(caught.value)
    assert "'\\t'" in message and "'é'" in message and "\n" not in message


def test_bad_vocabulary_and_ids_are_rejected():
    with pytest.raises(DataError, match="repeats 'a'"):
        CharVocab("abca")
    vocab = CharVocab("abc")
    for bad_ids in ([0, 3], [-1]):
        with pytest.raises(DataError, match="outside the vocabulary"):
            vocab.decode(bad_ids)


# --- obtaining and preparing the data -----------------------------------------------------------------------------

@pytest.mark.skipif(REAL_INPUT is None, reason=NO_REAL_DATA)
def test_real_data_set_splits_90_10(tmp_path):
    prepared = prepare_shakespeare(tmp_path, url=REAL_INPUT.as_uri())  # the default sha256 must match it
    text = REAL_INPUT.read_text(encoding="utf-8")
    assert (tmp_path / "input.txt").read_bytes() == REAL_INPUT.read_bytes()
    assert len(prepared.vocab) == 65
    assert (len(prepared.train), len(prepared.val)) == (1_003_854, 111_540)
    assert prepared.train.dtype == np.uint16 and isinstance(prepared.train, np.memmap)
    assert prepared.vocab.decode(prepared.train) + prepared.vocab.decode(prepared.val) == text


def test_download_through_file_url_is_verified(tmp_path, small_source):
    url, sha256 = small_source
    root = tmp_path / "prepared" / "tiny"  # created on demand
    prepared = prepare_shakespeare(root, url=url, sha256=sha256)
    assert isinstance(prepared, PreparedData) and prepared.root == root
    assert (root / "input.txt").read_text(encoding="utf-8") == SMALL_TEXT
    assert sorted(p.name for p in root.iterdir()) == ["input.txt", "meta.json", "train.bin", "val.bin"]
    assert prepared.vocab == CharVocab.from_text(SMALL_TEXT)
    n_train = int(len(SMALL_TEXT) * 0.9)
    assert prepared.vocab.decode(prepared.train) == SMALL_TEXT[:n_train]
    assert prepared.vocab.decode(prepared.val) == SMALL_TEXT[n_train:]


def test_local_input_is_used_without_downloading(tmp_path):
    sha256 = write_source(tmp_path / "input.txt", SMALL_TEXT)
    missing_url = (tmp_path / "nowhere" / "input.txt").as_uri()
    prepared = prepare_shakespeare(tmp_path, url=missing_url, sha256=sha256)
    assert prepared.vocab.decode(prepared.val) == SMALL_TEXT[int(len(SMALL_TEXT) * 0.9):]


def test_hash_mismatch_on_download_leaves_nothing_behind(tmp_path, small_source):
    url, sha256 = small_source
    root = tmp_path / "prepared"
    root.mkdir()
    wrong = "0" * 64
    with pytest.raises(DataError) as caught:
        prepare_shakespeare(root, url=url, sha256=wrong)
    message = str(caught.value)
    assert sha256 in message and wrong in message and str(root / "input.txt") in message and "\n" not in message
    assert list(root.iterdir()) == []


def test_hash_mismatch_of_local_file_is_reported(tmp_path):
    write_source(tmp_path / "input.txt", SMALL_TEXT)
    with pytest.raises(DataError, match=f"input.txt has sha256 [0-9a-f]{{64}} but {SHA256} was expected"):
        prepare_shakespeare(tmp_path, url=(tmp_path / "nowhere.txt").as_uri())
    assert [p.name for p in tmp_path.iterdir()] == ["input.txt"]  # the user's file is kept, nothing built


def test_unreachable_source_says_where_to_put_the_file(tmp_path):
    url = (tmp_path / "offline" / "input.txt").as_uri()
    with pytest.raises(DataError, match=f"could not download .*save it as {tmp_path / 'input.txt'}"):
        prepare_shakespeare(tmp_path, url=url)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("kwargs, complaint", [
    ({"val_fraction": 0}, "val_fraction"), ({"val_fraction": 1.0}, "val_fraction"),
    ({"val_fraction": -0.1}, "val_fraction"), ({"url": "ftp://example.com/input.txt"}, "file:// URL"),
])
def test_bad_arguments_are_rejected(tmp_path, kwargs, complaint):
    with pytest.raises(DataError, match=complaint):
        prepare_shakespeare(tmp_path, **kwargs)
    assert list(tmp_path.iterdir()) == []


def test_prepared_files_are_reused(tmp_path, small_source, monkeypatch):
    url, sha256 = small_source
    first = prepare_shakespeare(tmp_path, url=url, sha256=sha256)
    before = file_states(tmp_path)

    def no_encoding(self, text):
        raise AssertionError("prepared data was encoded again")
    monkeypatch.setattr(CharVocab, "encode", no_encoding)
    second = prepare_shakespeare(tmp_path, url=url, sha256=sha256)
    assert file_states(tmp_path) == before
    assert second.vocab == first.vocab and np.array_equal(second.train, first.train)


def test_prepared_files_are_rebuilt_when_the_source_changes(tmp_path, small_source):
    url, sha256 = small_source
    prepare_shakespeare(tmp_path, url=url, sha256=sha256)
    new_text = SMALL_TEXT.upper() + "Exeunt.\n"
    new_sha256 = write_source(tmp_path / "input.txt", new_text)
    prepared = prepare_shakespeare(tmp_path, url=url, sha256=new_sha256)
    assert prepared.vocab == CharVocab.from_text(new_text)
    assert prepared.vocab.decode(prepared.train) + prepared.vocab.decode(prepared.val) == new_text


@pytest.mark.parametrize("damage", ["val_fraction", "truncated_bin", "corrupt_meta"])
def test_stale_or_damaged_prepared_files_are_rebuilt(tmp_path, small_source, damage):
    url, sha256 = small_source
    prepare_shakespeare(tmp_path, url=url, sha256=sha256)
    val_fraction = 0.1
    if damage == "val_fraction":
        val_fraction = 0.2
    elif damage == "truncated_bin":
        with open(tmp_path / "train.bin", "r+b") as f:
            f.truncate(10)
    else:
        (tmp_path / "meta.json").write_text("{not json")
    prepared = prepare_shakespeare(tmp_path, url=url, sha256=sha256, val_fraction=val_fraction)
    n_train = int(len(SMALL_TEXT) * (1 - val_fraction))
    assert prepared.vocab.decode(prepared.train) == SMALL_TEXT[:n_train]
    assert prepared.vocab.decode(prepared.val) == SMALL_TEXT[n_train:]


def test_staging_folders_left_by_a_killed_run_are_removed_and_fresh_ones_kept(tmp_path, small_source):
    url, sha256 = small_source
    stale, fresh = tmp_path / ".staging-killed", tmp_path / ".staging-running"
    for folder in (stale, fresh):
        folder.mkdir()
        (folder / "train.bin").write_bytes(b"half")
    old = time.time() - prepare.STALE_STAGING_S - 60
    os.utime(stale, (old, old))
    prepare_shakespeare(tmp_path, url=url, sha256=sha256)
    assert not stale.exists() and fresh.exists()  # another process may still be writing in a fresh one


def test_interrupted_rebuild_is_not_mistaken_for_a_finished_one(tmp_path, small_source, monkeypatch):
    url, sha256 = small_source
    prepare_shakespeare(tmp_path, url=url, sha256=sha256)
    edited_sha256 = write_source(tmp_path / "input.txt", SMALL_TEXT.swapcase())  # same length, other tokens
    move_unless_meta = prepare._move_into_place

    def interrupted_before_meta(staging, root, name):
        if name == "meta.json":
            raise KeyboardInterrupt
        move_unless_meta(staging, root, name)
    monkeypatch.setattr(prepare, "_move_into_place", interrupted_before_meta)
    with pytest.raises(KeyboardInterrupt):
        prepare_shakespeare(tmp_path, url=url, sha256=edited_sha256)
    monkeypatch.undo()

    write_source(tmp_path / "input.txt", SMALL_TEXT)  # back to the original: its old meta.json must not be trusted
    prepared = prepare_shakespeare(tmp_path, url=url, sha256=sha256)
    assert prepared.vocab.decode(prepared.train) + prepared.vocab.decode(prepared.val) == SMALL_TEXT


def test_own_text_is_prepared_in_a_folder_of_its_own(tmp_path):
    datasets = tmp_path / "datasets"
    notes, edited = tmp_path / "notes.txt", tmp_path / "other" / "notes.txt"
    edited.parent.mkdir()
    own = "Le café est très bon.\nNaïve déjà vu.\n" * 30
    sha256 = write_source(notes, own)
    prepared = prepare_text(notes, datasets)
    assert prepared.root == datasets / f"notes-{sha256[:12]}"
    assert (prepared.source, prepared.sha256) == (str(notes), sha256)
    assert sorted(p.name for p in prepared.root.iterdir()) == ["meta.json", "train.bin", "val.bin"]
    assert prepared.vocab == CharVocab.from_text(own)
    assert prepared.vocab.decode(prepared.train) + prepared.vocab.decode(prepared.val) == own
    # another text of the same name gets a folder of its own: nothing prepared is shared or overwritten
    before = file_states(prepared.root)
    other = prepare_text(edited, datasets) if write_source(edited, own.upper()) else None
    assert other.root != prepared.root and other.vocab == CharVocab.from_text(own.upper())
    assert file_states(prepared.root) == before
    assert prepare_text(notes, datasets).root == prepared.root  # and the same text finds its files again


@pytest.mark.parametrize("make, complaint", [
    (lambda path: None, "cannot read the text .*No such file"),
    (lambda path: path.mkdir(), "the text .* is not a regular file"),
    (lambda path: path.write_bytes(b"caf\xe9\n" * 50), "not UTF-8 text"),
    (lambda path: path.write_text("a"), "leaves an empty train or val split"),
    (lambda path: path.write_text(""), "is empty; give a text to train on"),
])
def test_an_own_text_that_cannot_be_used_is_one_line(tmp_path, make, complaint):
    path = tmp_path / "mine.txt"
    make(path)
    with pytest.raises(DataError, match=complaint) as caught:
        prepare_text(path, tmp_path / "datasets")
    assert str(path) in str(caught.value) and "\n" not in str(caught.value)


# --- batches ------------------------------------------------------------------------------------------------------

@pytest.fixture
def distinct_tokens(tmp_path):
    """A uint16 memmap whose tokens are all different, so a window's first token gives away its offset."""
    tokens = np.random.default_rng(0).permutation(5000).astype(np.uint16)
    tokens.tofile(tmp_path / "tokens.bin")
    return np.memmap(tmp_path / "tokens.bin", dtype=np.uint16, mode="r")


def test_targets_are_inputs_shifted_by_one(distinct_tokens):
    block_size, batch_size = 16, 8
    x, y = Batches(distinct_tokens, block_size, batch_size).next()
    assert x.shape == y.shape == (batch_size, block_size)
    assert x.dtype == y.dtype == torch.int64 and x.is_contiguous() and y.is_contiguous()
    position_of = np.argsort(distinct_tokens)
    for row_x, row_y in zip(x.numpy(), y.numpy()):
        offset = position_of[row_x[0]]
        assert np.array_equal(row_x, distinct_tokens[offset:offset + block_size])
        assert np.array_equal(row_y, distinct_tokens[offset + 1:offset + block_size + 1])


def test_every_window_is_drawn_and_none_runs_past_the_end():
    tokens = np.arange(20, dtype=np.uint16)
    batches = Batches(tokens, block_size=5, batch_size=32, seed=3)
    offsets = set()
    for _ in range(20):
        x, y = batches.next()
        offsets.update(x[:, 0].tolist())
        assert int(y.max()) <= 19
    assert offsets == set(range(20 - 5))


def test_same_seed_same_batches_different_seed_different(distinct_tokens):
    def draw(seed):
        batches = Batches(distinct_tokens, block_size=8, batch_size=4, seed=seed)
        return torch.cat([torch.cat(batches.next()) for _ in range(3)])
    assert torch.equal(draw(seed=7), draw(seed=7))
    assert not torch.equal(draw(seed=7), draw(seed=8))


def test_batches_leave_the_global_rng_alone(distinct_tokens):
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    Batches(distinct_tokens, block_size=8, batch_size=4).next()
    assert torch.equal(torch.rand(3), expected)


def test_state_dict_round_trip_continues_the_same_sequence(distinct_tokens):
    batches = Batches(distinct_tokens, block_size=8, batch_size=4, seed=1)
    for _ in range(5):
        batches.next()
    saved = io.BytesIO()
    torch.save(batches.state_dict(), saved)  # as a checkpoint would hold it
    expected = [batches.next() for _ in range(3)]

    saved.seek(0)
    resumed = Batches(distinct_tokens, block_size=8, batch_size=4, seed=99)
    resumed.load_state_dict(torch.load(saved, weights_only=True))
    for want, got in zip(expected, [resumed.next() for _ in range(3)]):
        assert torch.equal(want[0], got[0]) and torch.equal(want[1], got[1])
    with pytest.raises(DataError, match="generator"):
        resumed.load_state_dict({})


def test_bad_batch_shapes_are_rejected(distinct_tokens):
    with pytest.raises(DataError, match="block_size 5000 .* 5000 tokens"):
        Batches(distinct_tokens, block_size=5000, batch_size=4)
    with pytest.raises(DataError, match="at least 1"):
        Batches(distinct_tokens, block_size=8, batch_size=0)
