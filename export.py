"""Export a trained kvgpt checkpoint to Hugging Face transformers or to ONNX (docs/export.md).

    python export.py --checkpoint runs/2024-05-01_12-00-00 exported/            # transformers' folder
    python export.py --checkpoint runs/2024-05-01_12-00-00 exported-onnx/ --format onnx

The hf folder loads with AutoModelForCausalLM and AutoTokenizer, and `sample.py --checkpoint` reads it back. The onnx
folder holds one decoder that takes and returns the KV cache. Both give kvgpt's logits; a design with no exact
equivalent is refused. A mistake is one line on stderr with exit status 2, before anything is written; a failed
write (a full disk) is one line with status 1, and leaves no half-written folder.
"""

from pathlib import Path

from exporting.folder import FORMATS, export
from runtime.errors import OneLineErrorParser, OutputError, check_standard_streams, fail, mistakes


def build_parser() -> OneLineErrorParser:
    parser = OneLineErrorParser(prog="export.py", description="Export a kvgpt checkpoint to transformers or ONNX.")
    parser.add_argument("out", metavar="OUT", type=Path, help="the new folder to write (absent or empty)")
    parser.add_argument("--checkpoint", metavar="RUN", type=Path, required=True,
                        help="checkpoint file or run directory (its best.pt)")
    parser.add_argument("--format", choices=FORMATS, default="hf",
                        help="hf: a transformers folder (default); onnx: an ONNX decoder with its KV cache")
    parser.add_argument("--precision", default="fp32", choices=("fp32", "bf16", "int8"),
                        help="only fp32: the exported weights are the checkpoint's float32 ones")
    return parser


def main(argv=None) -> None:
    parser = build_parser()
    try:
        check_standard_streams()
        args = parser.parse_args(argv)
        out = export(args.checkpoint, args.out, args.format, args.precision)
        print(f"exported {args.checkpoint} to {out} ({args.format})")
    except (*mistakes(), OutputError, OSError, KeyboardInterrupt) as e:
        fail(parser.prog, e)


if __name__ == "__main__":
    main()
