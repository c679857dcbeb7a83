"""Export a trained kvgpt checkpoint to Hugging Face transformers or to ONNX (docs/export.md).

    python export.py --checkpoint runs/2024-05-01_12-00-00 exported/            # transformers' folder
    python export.py --checkpoint runs/2024-05-01_12-00-00 exported-onnx/ --format onnx
    python export.py --checkpoint runs/2024-05-01_12-00-00 exported-gguf/ --format gguf    # llama.cpp's model.gguf

The hf folder loads with AutoModelForCausalLM and AutoTokenizer, and `sample.py --checkpoint` reads it back. The onnx
folder holds one decoder that takes and returns the KV cache. Both give kvgpt's logits; a design with no exact
equivalent is refused. A mistake is one line on stderr with exit status 2, before anything is written; a failed
write (a full disk) is one line with status 1, and leaves no half-written folder. Ctrl-C, SIGTERM or SIGHUP stops the
export, removes what it wrote, and exits with 128 + the signal's number (130 for Ctrl-C, 143 for SIGTERM).
"""

import sys

from runtime.installed import DECODING, require_installed
from runtime.stop_signals import ignoring_stop_signals_after, record_stop_signals

if __name__ == "__main__":
    require_installed("export.py", DECODING)
EARLY_SIGNALS = record_stop_signals() if __name__ == "__main__" else []  # while the modules below load

from pathlib import Path  # noqa: E402

from exporting.folder import FORMATS, export  # noqa: E402
from runtime.command import run_command  # noqa: E402
from runtime.errors import Interrupted, OneLineErrorParser, OutputError, one_line  # noqa: E402
from runtime.streams import flush_standard_output, silence  # noqa: E402
from runtime.signals import StopSignals  # noqa: E402


def build_parser() -> OneLineErrorParser:
    parser = OneLineErrorParser(prog="export.py",
                                description="Export a kvgpt checkpoint to transformers, ONNX or llama.cpp.")
    parser.add_argument("out", metavar="OUT", type=Path, help="the new folder to write (absent or empty)")
    parser.add_argument("--checkpoint", metavar="RUN", type=Path, required=True,
                        help="checkpoint file or run directory (its best.pt)")
    parser.add_argument("--format", choices=FORMATS, default="hf",
                        help="hf: a transformers folder (default); onnx: an ONNX decoder with its KV cache; "
                             "gguf: one GGUF file for llama.cpp")
    parser.add_argument("--precision", default="fp32", choices=("fp32", "bf16", "int8"),
                        help="only fp32: the exported weights are the checkpoint's float32 ones")
    return parser


def say_exported(line: str) -> None:
    """The export's last line. The export is whole by then: if the line cannot be written, the error says so."""
    try:
        print(line)
        flush_standard_output()
    except BrokenPipeError:  # the reader stopped early: nothing more is wanted
        raise
    except (OSError, OutputError) as e:
        silence(sys.stdout)  # what it still holds would fail again, and hide this error
        raise OutputError(f"{line}, but could not say so on standard output ({one_line(e)})") from None


def main(argv=None) -> None:
    parser = build_parser()

    def command():
        args = parser.parse_args(argv)
        if EARLY_SIGNALS:
            raise Interrupted(EARLY_SIGNALS[0])
        out = export(args.checkpoint, args.out, args.format, args.precision, signals,
                     warn=lambda line: print(f"{parser.prog}: warning: {line}", file=sys.stderr))
        say_exported(f"exported {args.checkpoint} to {out} ({args.format})")

    with StopSignals() as signals:  # the first stop signal ends the export at its next step, a second at once
        run_command(parser.prog, command)


if __name__ == "__main__":
    with ignoring_stop_signals_after():  # the export is whole or gone by then
        main()
