"""export(): a checkpoint written as a folder that transformers or onnxruntime loads, all at once or not at all.

Every refusal comes before anything is written. The folder is written beside OUT under a temporary name and
renamed to OUT at the end, so a failed export (a full disk, Ctrl-C) leaves no half-written folder."""

import json
import os
import shutil
import uuid
from pathlib import Path

from runtime.checkpoint import load_model, resolve_checkpoint
from runtime.errors import OutputError, UsageError, one_line
from runtime.files import cannot_make_a_file_in

from .card import facts, generation_config, model_card
from .hf import check_layers, model_type, to_hf
from .tokenizer import write_tokenizer

FORMATS = ("hf", "onnx")
PRECISIONS = ("fp32",)  # exports hold float32 weights: kvgpt's bf16 and int8 are conversions made when sampling


def check_out(out: Path) -> None:
    """A UsageError unless out can become the exported folder: absent or empty, in a writable folder."""
    if out.exists() and not out.is_dir():
        raise UsageError(f"{out} is a file; pass a new folder to export into")
    if out.is_dir() and any(out.iterdir()):
        raise UsageError(f"{out} exists and is not empty; pass a new or empty folder, nothing was overwritten")
    parent = out.absolute().parent
    if not parent.is_dir():
        raise UsageError(f"{parent} does not exist; create it first or export elsewhere")
    error = cannot_make_a_file_in(parent) or (None if os.access(parent, os.W_OK | os.X_OK) else
                                              PermissionError("Permission denied"))
    if error:
        raise UsageError(f"cannot write in {parent} ({one_line(error)}); export into a folder you can write")


def check_precision(precision: str) -> None:
    if precision not in PRECISIONS:
        raise UsageError(f"--precision {precision} cannot be exported: an export holds the float32 weights, which "
                         f"give kvgpt's logits exactly; drop --precision (bf16 and int8 apply when sampling)")


def export(checkpoint, out, fmt: str = "hf", precision: str = "fp32") -> Path:
    """Write checkpoint's model into the new folder out, in format fmt ("hf": transformers; "onnx")."""
    out = Path(out)
    if fmt not in FORMATS:
        raise UsageError(f"--format {fmt} is not one of {', '.join(FORMATS)}")
    check_precision(precision)
    check_out(out)
    path = resolve_checkpoint(checkpoint)
    model, vocab, contents = load_model(path)
    try:
        kind = model_type(model.config)
        check_layers(model)
    except ValueError as e:
        raise UsageError(f"{path} cannot be exported: {e}") from None
    parent = out.absolute().parent
    temporary = parent / f".{out.name[:64]}.{uuid.uuid4().hex}.partial"
    try:
        os.mkdir(temporary)  # 0777 less the umask, as any new folder; its files get 0666 less it, as any new ones
        write_folder(model, vocab, contents, kind, fmt, temporary)
        if out.is_dir():
            out.rmdir()  # empty, as check_out found it: rename puts the new folder in its place
        os.rename(temporary, out)
    except OSError as e:
        raise OutputError(f"cannot export to {out} ({one_line(e)}); nothing was left there") from None
    finally:
        shutil.rmtree(temporary, ignore_errors=True)
    return out


def write_folder(model, vocab, contents: dict, kind: str, fmt: str, folder: Path) -> None:
    """The export's files: the model, the tokenizer and the model card."""
    config = model.config
    if fmt == "hf":
        write_hf(model, contents, folder)
    else:
        from .onnx import write_onnx
        write_onnx(model, folder / "model.onnx")
    write_tokenizer(vocab, folder)
    (folder / "README.md").write_text(model_card(config, kind, fmt, contents), encoding="utf-8")


def write_hf(model, contents: dict, folder: Path) -> None:
    """config.json, model.safetensors (its metadata: what the checkpoint records) and generation_config.json."""
    from safetensors.torch import save
    from transformers import AutoConfig
    fields, tensors = to_hf(model)
    kind = fields.pop("model_type")
    AutoConfig.for_model(kind, **fields).to_json_file(folder / "config.json", use_diff=False)
    # written by Python: a full disk is an OSError, which safetensors' own writer reports as its SafetensorError
    (folder / "model.safetensors").write_bytes(save(tensors, metadata={"format": "pt", **facts(contents)}))
    (folder / "generation_config.json").write_text(json.dumps(generation_config(model.config), indent=1) + "\n")
