"""export(): a checkpoint written as a folder that transformers or onnxruntime loads, all at once or not at all.

Every refusal comes before anything is written. OUT is where the export goes, its links followed (a link to a
folder not made yet too). A new OUT is written beside it under a temporary name and renamed at the end. An empty
folder that exists (the working folder, a mount point) is kept: the export is written in a hidden folder inside it,
and its files are moved out at the end. So a failed or stopped export (a full disk, Ctrl-C) leaves nothing behind."""

import json
import os
import shutil
import uuid
from pathlib import Path

from runtime.checkpoint import load_model, resolve_checkpoint
from runtime.errors import Interrupted, OutputError, UsageError, one_line
from runtime.files import cannot_make_a_file_in
from runtime.hf import GGUF_FILE, ONNX_FILE, SOURCE_KEY, check_layers, model_type, to_hf
from runtime.tokenizer import special_token, write_tokenizer

from .card import facts, generation_config, model_card
from .gguf import gguf_arch, gguf_warning, write_gguf

FORMATS = ("hf", "onnx", "gguf")
PRECISIONS = ("fp32",)  # exports hold float32 weights: kvgpt's bf16 and int8 are conversions made when sampling


def check_out(out: Path) -> Path:
    """Where the export goes: out with its links followed. A UsageError unless that is a new name or an empty
    folder, in a folder that can be written."""
    try:
        os.stat(out)
    except (FileNotFoundError, NotADirectoryError):  # new, or under a file (told below)
        pass
    except OSError as e:  # a link that leads back to itself, a name too long, a folder that cannot be searched
        raise UsageError(f"cannot export to {out} ({e.strerror}); pass a new or empty folder") from None
    target = Path(os.path.realpath(out))
    if target.exists() and not target.is_dir():
        raise UsageError(f"{out} is a file; pass a new folder to export into")
    if target.is_dir() and any(target.iterdir()):
        raise UsageError(f"{out} exists and is not empty; pass a new or empty folder, nothing was overwritten")
    if not target.parent.is_dir():
        there = "is a file, not a folder" if target.parent.exists() else "does not exist"
        raise UsageError(f"{target.parent} {there}; create the folder first or export elsewhere")
    home = target if target.is_dir() else target.parent  # where the files are first written
    error = cannot_make_a_file_in(home) or (None if os.access(home, os.W_OK | os.X_OK) else
                                            PermissionError("Permission denied"))
    if error:
        raise UsageError(f"cannot write in {home} ({one_line(error)}); export into a folder you can write")
    return target


def check_precision(precision: str) -> None:
    if precision not in PRECISIONS:
        raise UsageError(f"--precision {precision} cannot be exported: an export holds the float32 weights, which "
                         f"give kvgpt's logits exactly; drop --precision (bf16 and int8 apply when sampling)")


def export(checkpoint, out, fmt: str = "hf", precision: str = "fp32", signals=None, warn=None) -> Path:
    """Write checkpoint's model into the new or empty folder out, in format fmt ("hf": transformers; "onnx";
    "gguf": llama.cpp). signals: a StopSignals (runtime/signals.py), whose first stop signal ends the export at its
    next step and a second at once; either way what was written goes, and the export raises Interrupted.
    warn: called with a line where the export runs kvgpt's model only in part (a GGUF past block_size), or where
    the checkpoint records no character counts to choose the tokenizer's bos, eos and unk from."""
    out = Path(out)
    if fmt not in FORMATS:
        raise UsageError(f"--format {fmt} is not one of {', '.join(FORMATS)}")
    check_precision(precision)
    target = check_out(out)
    path = resolve_checkpoint(checkpoint)
    model, vocab, contents = load_model(path)
    try:
        kind = model_type(model.config) if fmt != "gguf" else gguf_arch(model)
        check_layers(model)
    except ValueError as e:
        raise UsageError(f"{path} cannot be exported: {e}") from None
    counts = (contents.get("text") or {}).get("char_counts")
    special = None if fmt == "gguf" else special_token(vocab, counts)  # a GGUF file names none
    line = gguf_warning(model) if fmt == "gguf" else None if counts is not None else unknown_counts(path, special)
    if warn is not None and line:
        warn(line)
    inside = target.is_dir()  # an empty folder that exists is kept, and its files are moved into it at the end
    temporary = (target if inside else target.parent) / f".{target.name[:64]}.{uuid.uuid4().hex}.partial"
    try:
        stop(signals)
        os.mkdir(temporary)  # 0777 less the umask, as any new folder; its files get 0666 less it, as any new ones
        for write in writes(model, vocab, special, contents, kind, fmt, path):
            stop(signals)
            write(temporary)
        finish(signals)  # from here on a signal is only noted: the export is whole
        stop(signals)
        put_in_place(temporary, target, inside)
    except BaseException as e:
        stop(signals)  # a stop signal came first: that is why, whatever a library made of the interrupt
        if isinstance(e, OSError):
            raise OutputError(f"cannot export to {out} ({one_line(e)}); nothing was left there") from None
        raise
    finally:
        finish(signals)  # a signal cannot stop the cleaning up
        shutil.rmtree(temporary, ignore_errors=True)
    return out


def unknown_counts(path: Path, special: str) -> str:
    """The line export.py prints for a checkpoint that records no character counts (an earlier kvgpt's)."""
    return (f"{path} records no character counts of its training text, so bos, eos and unk name the vocabulary's "
            f"last character, {special!r}: CTranslate2 and vLLM end the text there unless told not to")


def stop(signals) -> None:
    """Interrupted if a stop signal came."""
    if signals is not None and signals.signal_name is not None:
        raise Interrupted(signals.signal_name)


def finish(signals) -> None:
    """From now on a stop signal is only noted."""
    if signals is not None:
        signals.finished()


def put_in_place(temporary: Path, target: Path, inside: bool) -> None:
    """A new folder is renamed to target at once. Into an empty folder that exists (it may be the working folder
    or a mount point, which cannot be replaced) the files move one by one; if one cannot, those moved go again."""
    if not inside:
        os.rename(temporary, target)
        return
    moved = []
    try:
        for path in sorted(temporary.iterdir()):
            os.rename(path, target / path.name)
            moved.append(target / path.name)
    except OSError:
        for path in moved:
            path.unlink(missing_ok=True)
        raise


def writes(model, vocab, special: str | None, contents: dict, kind: str, fmt: str, source: Path) -> list:
    """The export's files, each written by one call on the folder: the model, the tokenizer (special named bos,
    eos and unk) and the model card. A stop signal ends the export between two. source: the checkpoint file
    exported."""
    def model_files(folder: Path) -> None:
        if fmt == "hf":
            write_hf(model, contents, folder, source)
        elif fmt == "gguf":  # one file, its tokenizer inside
            write_gguf(model, vocab, folder / GGUF_FILE)
        else:
            from .onnx import write_onnx
            write_onnx(model, folder / ONNX_FILE)

    card = model_card(model.config, kind, fmt, contents, special)
    tokenizer = [] if fmt == "gguf" else [lambda folder: write_tokenizer(vocab, special, folder)]
    return [model_files, *tokenizer, lambda folder: (folder / "README.md").write_text(card, encoding="utf-8")]


def write_hf(model, contents: dict, folder: Path, source: Path) -> None:
    """config.json, model.safetensors (its metadata: what the checkpoint records, and the checkpoint file itself,
    which a refused train.resume names) and generation_config.json."""
    from safetensors.torch import save
    from transformers import AutoConfig
    fields, tensors = to_hf(model)
    kind = fields.pop("model_type")
    AutoConfig.for_model(kind, **fields).to_json_file(folder / "config.json", use_diff=False)
    # written by Python: a full disk is an OSError, which safetensors' own writer reports as its SafetensorError
    metadata = {"format": "pt", **facts(contents), SOURCE_KEY: str(source.resolve())}
    (folder / "model.safetensors").write_bytes(save(tensors, metadata=metadata))
    (folder / "generation_config.json").write_text(json.dumps(generation_config(model.config), indent=1) + "\n")
