"""KV caches saved to a file and taken up again: a conversation's text and cache (sample.py --interactive --session
FILE), so that the next turn reads only the new line, or an engine's prefix blocks (BlockPool.export_prefix).

The file records which model wrote it: the checkpoint's path, the precision and device it decoded at, a
fingerprint of its weights as decoded (the precision included) and the cache's design, and a sha256 of all it
holds. A file from another model, another precision, another design or a damaged one (a byte changed, the checksum
no longer matching) is refused, never continued wrongly, with what differs and what to do. It is written atomically
and read with weights_only=True.
"""

import hashlib
import os
import stat
from pathlib import Path

import torch

from model.decoding.cached_text import text_cache
from model.decoding.quantize import converted_to
from runtime.files import write_atomically

FORMAT = "kvgpt-session-2"  # -2: with a checksum


class SessionError(Exception):
    """A session file that cannot be taken up: the message says why, in one line."""


def fingerprint(model) -> str:
    """sha256 of the model's weights as they decode (their dtype included), with the config: the same model or not."""
    digest = hashlib.sha256(repr(model.config).encode())
    for name, tensor in decoded_tensors(model).items():
        digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)}".encode())
        digest.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def decoded_tensors(model) -> dict:
    """The tensors the model decodes with: its state_dict, or for a model quantized to int8 (which refuses
    state_dict, so that it is never saved as an fp32 one) its parameters and buffers, the tied head's included."""
    if converted_to(model) != "int8":
        return model.state_dict()
    return {**dict(model.named_parameters(remove_duplicate=False)),
            **dict(model.named_buffers(remove_duplicate=False))}


def precision_of(model) -> str:
    """The --precision the model was converted to for decoding (model/decoding/quantize.py)."""
    converted = converted_to(model)
    return {None: "fp32", "bfloat16": "bf16"}.get(converted, converted)


def device_of(model) -> str:
    return next(model.parameters()).device.type


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
    contents = {"format": FORMAT, "checkpoint": str(Path(checkpoint).resolve()), "precision": precision_of(model),
                "device": device_of(model), "weights": fingerprint(model), **state}
    contents["checksum"] = checksum(contents)
    # through a link, the file it names is written: the link stays, and names the new file
    return write_atomically(Path(path).resolve(), lambda file: torch.save(contents, file))


def load_session(path, checkpoint, model) -> dict:
    """The Conversation state saved in path, for this model; SessionError if it is not one, a damaged one (its
    checksum does not match), or another model's, precision's or device's."""
    with open_regular(path) as file:
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
        raise SessionError(another_model(path, contents, checkpoint, model))
    check_cache_device(path, contents, model)
    return contents


def open_regular(path):
    """path opened for reading, refused unless a regular file: opened without waiting, as a pipe would."""
    try:
        descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as e:
        raise SessionError(f"cannot read the session {path}: {e.strerror or e}") from None
    if not stat.S_ISREG(os.fstat(descriptor).st_mode):
        os.close(descriptor)
        raise SessionError(f"{path} is not a regular file: give a session file, or a new name to start one")
    return open(descriptor, "rb")


def another_model(path, contents: dict, checkpoint, model) -> str:
    """Why a session's weights differ from the model's, and what to do: another precision, the checkpoint's
    weights changed since, or another checkpoint."""
    saved_with, precision = contents.get("checkpoint"), contents.get("precision")
    if precision is not None and precision != precision_of(model):
        return (f"{path} was saved at --precision {precision}, and its cache holds what the weights computed at "
                f"that precision: take it up with --precision {precision}, or start a new session under another "
                f"name")
    if saved_with and Path(saved_with).resolve() == Path(checkpoint).resolve():
        if precision is None:  # a file of an earlier version, which recorded no precision
            return (f"{path} was saved with {checkpoint} at another --precision than {precision_of(model)}, or "
                    f"with weights it no longer holds: take it up at the --precision it was saved at, or start a "
                    f"new session under another name")
        return (f"{path} was saved with the weights {checkpoint} held then; they have changed since (trained "
                f"further, or written again), and its cache holds what the old ones computed: start a new session "
                f"under another name")
    if saved_with and not Path(saved_with).exists():
        return (f"{path} was saved with the model in {saved_with}, which is no longer there: start a new "
                f"session under another name")
    return (f"{path} was saved with another model ({saved_with}), not {checkpoint}: take it up with "
            f"--checkpoint {saved_with}, or start a new session under another name")


def check_cache_device(path, contents: dict, model) -> None:
    """Refuse a session whose cache was kept in another dtype on another device (bf16 attention computes in
    float32 on the CPU, in bfloat16 on CUDA: model/attention.py), naming that device."""
    saved, device = contents.get("cache"), device_of(model)
    if contents.get("device") in (None, device) or not isinstance(saved, dict):
        return
    for name, tensor in text_cache(model).named_buffers():
        if isinstance(saved.get(name), torch.Tensor) and saved[name].dtype != tensor.dtype:
            raise SessionError(f"{path} was saved on {contents['device']}, whose cache holds "
                               f"{str(saved[name].dtype).removeprefix('torch.')} where {device}'s holds "
                               f"{str(tensor.dtype).removeprefix('torch.')}: take it up with --device "
                               f"{contents['device']}, or start a new session under another name")
