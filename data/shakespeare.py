"""tiny_shakespeare, obtained once, verified, and encoded to uint16 token files that later runs reuse.

    root/input.txt   the text (downloaded when absent), checked against its sha256 on every call
    root/train.bin   the first (1 - val_fraction) of the encoded text, uint16
    root/val.bin     the rest
    root/meta.json   what the .bin files were built from (source sha256, val_fraction, format) and the vocabulary

Every file is written to a temporary name and renamed into place, so an interrupted run never leaves a partial
file behind, and processes preparing the same root at once all end up with the same files.
"""

import hashlib
import http.client
import json
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .atomic import write_atomically
from .errors import DataError
from .vocab import CharVocab

SOURCE_URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
SHA256 = "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"
FORMAT = "kvgpt-chars-uint16-v1"  # bump when the layout of the prepared files changes
TOKEN_DTYPE = np.uint16
DOWNLOAD_TIMEOUT_S = 60


@dataclass(frozen=True)
class PreparedData:
    vocab: CharVocab
    train: np.ndarray  # read-only uint16 memmaps
    val: np.ndarray
    root: Path


def prepare_shakespeare(root, url: str = SOURCE_URL, sha256: str = SHA256, val_fraction: float = 0.1) -> PreparedData:
    """Obtain and verify root/input.txt (downloading `url` when it is absent), encode it unless root already holds
    files encoded from the same text with the same split, and open the train and val tokens as memmaps."""
    if not 0 < val_fraction < 1:
        raise DataError(f"val_fraction must be between 0 and 1 (exclusive), got {val_fraction}")
    if urllib.parse.urlsplit(url).scheme not in ("http", "https", "file"):
        raise DataError(f"cannot download {url!r}: give an http://, https:// or file:// URL")
    root = Path(root)
    source = root / "input.txt"
    if source.is_file():
        got = hashlib.sha256(source.read_bytes()).hexdigest()
        if got != sha256:
            raise DataError(f"{source} has sha256 {got} but {sha256} was expected; "
                            f"replace it with the right file or delete it to download {url}")
    else:
        root.mkdir(parents=True, exist_ok=True)
        _download(url, source, sha256)

    meta = _read_meta(root)
    if not _matches(meta, root, sha256, val_fraction):
        meta = _encode(source, root, sha256, val_fraction)
    return PreparedData(vocab=CharVocab(meta["vocab"]),
                        train=np.memmap(root / "train.bin", dtype=TOKEN_DTYPE, mode="r"),
                        val=np.memmap(root / "val.bin", dtype=TOKEN_DTYPE, mode="r"),
                        root=root)


def _download(url: str, target: Path, sha256: str) -> None:
    def fetch_and_verify(file):
        digest = hashlib.sha256()
        try:
            with urllib.request.urlopen(url, timeout=DOWNLOAD_TIMEOUT_S) as response:
                while chunk := response.read(1 << 20):
                    digest.update(chunk)
                    file.write(chunk)
        except (OSError, http.client.HTTPException) as e:  # urllib's errors and timeouts are OSErrors
            raise DataError(f"could not download {url} ({getattr(e, 'reason', e)}); "
                            f"download it yourself and save it as {target}") from None
        if digest.hexdigest() != sha256:
            raise DataError(f"{url} has sha256 {digest.hexdigest()} but {sha256} was expected; "
                            f"save the right file as {target}")

    write_atomically(target, fetch_and_verify)


def _read_meta(root: Path) -> dict | None:
    try:
        return json.loads((root / "meta.json").read_text())
    except (OSError, ValueError):  # missing or damaged: the files get rebuilt
        return None


def _matches(meta: dict | None, root: Path, sha256: str, val_fraction: float) -> bool:
    """Whether root's prepared files were built from this source with this split, and are complete."""
    if not isinstance(meta, dict) or not isinstance(meta.get("vocab"), str):
        return False
    if (meta.get("format"), meta.get("source_sha256"), meta.get("val_fraction")) != (FORMAT, sha256, val_fraction):
        return False
    itemsize = np.dtype(TOKEN_DTYPE).itemsize
    return all((root / f"{split}.bin").is_file()
               and (root / f"{split}.bin").stat().st_size == meta.get(f"{split}_tokens", -1) * itemsize
               for split in ("train", "val"))


def _encode(source: Path, root: Path, sha256: str, val_fraction: float) -> dict:
    try:
        text = source.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{source} is not UTF-8 text ({e.reason} at byte {e.start}); "
                        f"replace it with a UTF-8 text file") from None
    vocab = CharVocab.from_text(text)
    if len(vocab) > np.iinfo(TOKEN_DTYPE).max + 1:
        raise DataError(f"{source} has {len(vocab)} distinct characters, more than {TOKEN_DTYPE.__name__} "
                        f"token files can hold; use a text with at most {np.iinfo(TOKEN_DTYPE).max + 1}")
    tokens = np.array(vocab.encode(text), dtype=TOKEN_DTYPE)
    n_train = int(len(tokens) * (1 - val_fraction))
    if not 0 < n_train < len(tokens):
        raise DataError(f"val_fraction {val_fraction} of {len(tokens)} characters leaves an empty train or val "
                        f"split; use a longer text or a val_fraction nearer 0.1")

    # Without meta.json the .bin files count as stale, so a run interrupted mid-rebuild starts over next time.
    (root / "meta.json").unlink(missing_ok=True)
    write_atomically(root / "train.bin", tokens[:n_train].tofile)
    write_atomically(root / "val.bin", tokens[n_train:].tofile)
    meta = {"format": FORMAT, "source_sha256": sha256, "val_fraction": val_fraction,
            "train_tokens": n_train, "val_tokens": len(tokens) - n_train, "vocab": vocab.chars}
    write_atomically(root / "meta.json", lambda f: f.write(json.dumps(meta, indent=1).encode()))
    return meta
