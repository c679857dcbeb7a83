"""Texts obtained once, verified, and encoded to uint16 token files that later runs reuse: tiny_shakespeare, or
a UTF-8 text file of your own.

    root/input.txt   tiny_shakespeare only: the text (downloaded when absent), checked against its sha256 on every call
    root/train.bin   the first (1 - val_fraction) of the encoded text, uint16
    root/val.bin     the rest
    root/meta.json   what the .bin files were built from (source sha256, val_fraction, format) and the vocabulary

A text of your own is read where it is, on every call, and prepared in a folder named after it and its sha256,
so that two texts (or two versions of one) never share prepared files.

Every file is written whole in a private staging folder inside root, then renamed into place (meta.json last),
so an interrupted run never leaves a partial file behind, and processes preparing the same root at once all end up
with the same files. The prepared files are trusted only while meta.json matches the source, the split, the
vocabulary of the text, and the files' own sha256.
"""

import errno
import hashlib
import http.client
import json
import os
import shutil
import stat
import tempfile
import time
import urllib.parse
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .errors import DataError
from .vocab import CharVocab

SHAKESPEARE = "tiny_shakespeare"
DATASETS = "datasets"  # where prepared texts go unless told otherwise
VAL_FRACTION = 0.1  # the last tenth of the text
SOURCE_URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
SHA256 = "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"
FORMAT = "kvgpt-chars-uint16-v2"  # bump when the layout of the prepared files changes
TOKEN_DTYPE = np.uint16
DOWNLOAD_TIMEOUT_S = 60
STALE_STAGING_S = 3600
MACHINE_FAILURES = (errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EFBIG)  # the disk's or the system's, not the folder's


@dataclass(frozen=True)
class PreparedData:
    vocab: CharVocab
    train: np.ndarray  # read-only uint16 memmaps
    val: np.ndarray
    root: Path
    source: str  # what the text is: tiny_shakespeare, or the path of your own file
    sha256: str  # the text file's


def prepare_training_text(text=None, datasets_dir=DATASETS, val_fraction: float = VAL_FRACTION) -> PreparedData:
    """The text a run trains on: tiny_shakespeare when text is None (in datasets_dir/tiny_shakespeare/), else your
    own file at the path `text`."""
    if text is None:
        return prepare_shakespeare(Path(datasets_dir) / SHAKESPEARE, val_fraction=val_fraction)
    return prepare_text(text, datasets_dir, val_fraction=val_fraction)


def prepare_shakespeare(root, url: str = SOURCE_URL, sha256: str = SHA256,
                        val_fraction: float = VAL_FRACTION) -> PreparedData:
    """Obtain and verify root/input.txt (downloading `url` when it is absent), encode it unless root already holds
    files encoded from the same text with the same split, and open the train and val tokens as memmaps."""
    _check_val_fraction(val_fraction)
    if urllib.parse.urlsplit(url).scheme not in ("http", "https", "file"):
        raise DataError(f"cannot download {url!r}: give an http://, https:// or file:// URL")
    root = Path(root)
    source = root / "input.txt"
    with _os_errors_as_data_errors(root):
        if source.is_file():
            text_bytes = read_regular_file(source)
            got = hashlib.sha256(text_bytes).hexdigest()
            if got != sha256:
                raise DataError(f"{source} has sha256 {got} but {sha256} was expected; "
                                f"replace it with the right file or delete it to download {url}")
        else:
            root.mkdir(parents=True, exist_ok=True)
            text_bytes = _download(url, root, sha256)
        return _prepared(root, _decode(text_bytes, source), source, SHAKESPEARE, sha256, val_fraction)


def prepare_text(path, datasets_dir, val_fraction: float = VAL_FRACTION) -> PreparedData:
    """Your own UTF-8 text file at path, encoded in datasets_dir/<its name>-<its sha256's first 12 digits>/ unless
    that folder already holds it encoded with the same split; the train and val tokens as memmaps."""
    _check_val_fraction(val_fraction)
    path = Path(path)
    try:
        text_bytes = read_regular_file(path)
    except DataError as e:
        raise DataError(f"the text {e}") from None
    except OSError as e:
        raise DataError(f"cannot read the text {path} ({e.strerror or e}); give the path of a UTF-8 text file") \
            from None
    sha256 = hashlib.sha256(text_bytes).hexdigest()
    text = _decode(text_bytes, path)
    root = Path(datasets_dir) / f"{path.stem}-{sha256[:12]}"
    with _os_errors_as_data_errors(root):
        root.mkdir(parents=True, exist_ok=True)
        return _prepared(root, text, path, str(path), sha256, val_fraction)


def read_regular_file(path) -> bytes:
    """The bytes of the regular file at path. Anything else (a folder, a pipe, a device such as /dev/zero) is a
    DataError before any read: a pipe with no writer would never open, and a device might never end."""
    descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # opening a pipe waits for a writer otherwise
    if not stat.S_ISREG(os.fstat(descriptor).st_mode):
        os.close(descriptor)
        raise DataError(f"{path} is not a regular file (a folder, a pipe or a device); give a text file")
    with open(descriptor, "rb") as file:
        return file.read()


def _check_val_fraction(val_fraction: float) -> None:
    if not 0 < val_fraction < 1:
        raise DataError(f"val_fraction must be between 0 and 1 (exclusive), got {val_fraction}")


@contextmanager
def _os_errors_as_data_errors(root: Path):
    try:
        yield
    except OSError as e:  # a read-only or full disk, a file where the folder should be, ...
        message = f"cannot prepare the data in {root} ({e.strerror or e}{': ' + e.filename if e.filename else ''})"
        if e.errno in MACHINE_FAILURES:  # not the folder's fault: an OSError, for the caller to report as such
            raise OSError(e.errno, f"{message}; free some space, or give data.root another disk") from None
        raise DataError(f"{message}; give data.root a writable folder") from None


def _prepared(root: Path, text: str, source: Path, name: str, sha256: str, val_fraction: float) -> PreparedData:
    meta = _read_meta(root)
    if not _matches(meta, root, sha256, val_fraction, text):
        meta = _encode(text, source, root, sha256, val_fraction)
    return PreparedData(vocab=CharVocab(meta["vocab"]),
                        train=np.memmap(root / "train.bin", dtype=TOKEN_DTYPE, mode="r"),
                        val=np.memmap(root / "val.bin", dtype=TOKEN_DTYPE, mode="r"),
                        root=root, source=name, sha256=sha256)


@contextmanager
def _staging(root: Path):
    """A private folder inside root in which files are written whole before they are moved into place.
    Staging folders older than STALE_STAGING_S were left by a process killed mid-way (preparing takes
    seconds) and are removed first."""
    for old in root.glob(".staging-*"):
        try:
            if time.time() - old.stat().st_mtime > STALE_STAGING_S:
                shutil.rmtree(old, ignore_errors=True)
        except FileNotFoundError:  # another process removed it first
            pass
    staging = Path(tempfile.mkdtemp(dir=root, prefix=".staging-"))
    try:
        yield staging
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _move_into_place(staging: Path, root: Path, name: str) -> None:
    os.replace(staging / name, root / name)


def _download(url: str, root: Path, sha256: str) -> bytes:
    target = root / "input.txt"
    with _staging(root) as staging:
        try:
            with urllib.request.urlopen(url, timeout=DOWNLOAD_TIMEOUT_S) as response:
                body = response.read()
        except (OSError, http.client.HTTPException) as e:  # urllib's errors and timeouts are OSErrors
            raise DataError(f"could not download {url} ({getattr(e, 'reason', e)}); "
                            f"download it yourself and save it as {target}") from None
        got = hashlib.sha256(body).hexdigest()
        if got != sha256:
            raise DataError(f"{url} has sha256 {got} but {sha256} was expected; save the right file as {target}")
        (staging / "input.txt").write_bytes(body)
        _move_into_place(staging, root, "input.txt")
    return body


def _decode(text_bytes: bytes, source: Path) -> str:
    try:
        return text_bytes.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{source} is not UTF-8 text ({e.reason} at byte {e.start}); "
                        f"replace it with a UTF-8 text file") from None


def _read_meta(root: Path) -> dict | None:
    try:
        return json.loads((root / "meta.json").read_text())
    except (OSError, ValueError):  # missing or damaged: the files get rebuilt
        return None


def _file_sha256(path: Path) -> str | None:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return None


def _matches(meta: dict | None, root: Path, sha256: str, val_fraction: float, text: str) -> bool:
    """Whether root's prepared files were built from this text with this split, and are intact."""
    if not isinstance(meta, dict) or meta.get("vocab") != CharVocab.from_text(text).chars:
        return False
    if (meta.get("format"), meta.get("source_sha256"), meta.get("val_fraction")) != (FORMAT, sha256, val_fraction):
        return False
    return all(_file_sha256(root / f"{split}.bin") == meta.get(f"{split}_sha256") for split in ("train", "val"))


def _encode(text: str, source: Path, root: Path, sha256: str, val_fraction: float) -> dict:
    if not text:
        raise DataError(f"{source} is empty; give a text to train on")
    vocab = CharVocab.from_text(text)
    if len(vocab) > np.iinfo(TOKEN_DTYPE).max + 1:
        raise DataError(f"{source} has {len(vocab)} distinct characters, more than {TOKEN_DTYPE.__name__} "
                        f"token files can hold; use a text with at most {np.iinfo(TOKEN_DTYPE).max + 1}")
    tokens = np.array(vocab.encode(text), dtype=TOKEN_DTYPE)
    n_train = int(len(tokens) * (1 - val_fraction))
    if not 0 < n_train < len(tokens):
        raise DataError(f"val_fraction {val_fraction} of the {len(tokens)} characters of {source} leaves an empty "
                        f"train or val split; use a longer text or a val_fraction nearer 0.1")
    splits = {"train": tokens[:n_train], "val": tokens[n_train:]}
    meta = {"format": FORMAT, "source_sha256": sha256, "val_fraction": val_fraction, "vocab": vocab.chars}
    # Without meta.json the .bin files count as stale, so a run interrupted mid-rebuild starts over next time.
    (root / "meta.json").unlink(missing_ok=True)
    with _staging(root) as staging:
        for split, split_tokens in splits.items():
            (staging / f"{split}.bin").write_bytes(split_tokens.tobytes())  # tofile's short write has no errno
            meta[f"{split}_tokens"] = len(split_tokens)
            meta[f"{split}_sha256"] = _file_sha256(staging / f"{split}.bin")
        (staging / "meta.json").write_text(json.dumps(meta, indent=1))
        for name in ("train.bin", "val.bin", "meta.json"):
            _move_into_place(staging, root, name)
    return meta
