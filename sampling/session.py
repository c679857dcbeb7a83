"""KV caches saved to a file and taken up again: a conversation's text and cache (sample.py --interactive --session
FILE), so that the next turn reads only the new line, or an engine's prefix blocks (Engine.export_prefix).

The file records which model wrote it: the checkpoint's path, a fingerprint of its weights as decoded (the
precision included) and the cache's design, and a sha256 of all it holds. A file from another model, another design
or a damaged one (a byte changed, the checksum no longer matching) is refused, never continued wrongly. It is
written atomically and read with weights_only=True.
"""

import hashlib
from pathlib import Path

import torch

from runtime.files import write_atomically

FORMAT = "kvgpt-session-2"  # -2: with a checksum


class SessionError(Exception):
    """A session file that cannot be taken up: the message says why, in one line."""


def fingerprint(model) -> str:
    """sha256 of the model's weights as they decode (their dtype included), with the config: the same model or not."""
    digest = hashlib.sha256(repr(model.config).encode())
    for name, tensor in model.state_dict().items():
        digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)}".encode())
        digest.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def checksum(contents: dict) -> str:
    """sha256 of a session's contents, its checksum aside: strings, ints and tensors (dtype, shape and bytes), in
    order of their names. TypeError for anything else, which no session holds."""
    digest = hashlib.sha256()

    def add(name, value):
        if isinstance(value, dict):
            for key in sorted(value):
                add(f"{name}.{key}", value[key])
        elif isinstance(value, torch.Tensor):
            digest.update(f"{name}:{value.dtype}:{tuple(value.shape)}".encode())
            digest.update(value.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        elif isinstance(value, (str, int)):
            digest.update(f"{name}:{type(value).__name__}:{value}".encode())
        else:
            raise TypeError(f"{name} is a {type(value).__name__}")

    add("", {key: value for key, value in contents.items() if key != "checksum"})
    return digest.hexdigest()


def save_session(path, state: dict, checkpoint, model) -> Path:
    """Write a Conversation.state() atomically, with what identifies the model that made it and a checksum."""
    contents = {"format": FORMAT, "checkpoint": str(checkpoint), "weights": fingerprint(model), **state}
    contents["checksum"] = checksum(contents)
    # through a link, the file it names is written: the link stays, and names the new file
    return write_atomically(Path(path).resolve(), lambda file: torch.save(contents, file))


def load_session(path, checkpoint, model) -> dict:
    """The Conversation state saved in path, for this model; SessionError if it is not one, a damaged one (its
    checksum does not match), or another model's."""
    try:
        file = open(path, "rb")
    except OSError as e:
        raise SessionError(f"cannot read the session {path}: {e.strerror or e}") from None
    with file:
        try:
            contents = torch.load(file, map_location="cpu", weights_only=True)
        except Exception:  # unpickling and zip errors have many types
            raise SessionError(f"{path} is damaged or not a session file: start a new one under another "
                               f"name") from None
    if not isinstance(contents, dict) or contents.get("format") != FORMAT:
        raise SessionError(f"{path} is not a session file of this version: start a new one under another name")
    try:
        intact = contents.get("checksum") == checksum(contents)
    except TypeError:
        intact = False
    if not intact:
        raise SessionError(f"{path} is damaged: what it holds no longer matches its checksum; start a new one under "
                           f"another name")
    if contents.get("weights") != fingerprint(model):
        raise SessionError(f"{path} was saved with another model ({contents.get('checkpoint')}, or another "
                           f"--precision), not {checkpoint}: give that checkpoint, or start a new session")
    return contents
