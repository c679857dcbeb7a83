"""How long a user waits for sample.py: from the command to its first generated character, and to --interactive's
banner, as a terminal shows them.

    python bench/start_up.py --checkpoint runs/RUN
    python bench/start_up.py --checkpoint runs/RUN --repeats 7 --threads 1

Each run is the real command on a pseudo-terminal, as a user starts it: its standard output is the terminal, so
each character is written as it comes. The clock starts before the process does and stops at the first
character after the prompt, or at the first character of the banner on standard error. The floor beside them is
`python -c "import torch"`, which every command pays first. Runs take turns; median (min-max) of --repeats. The
first run of each kind is a warm-up, not counted: the page cache then holds torch, as on a machine in use.
--compile also times a run that decodes through the checkpoint's compiled step, kept in a temporary folder
(compiled before the clock starts).
"""

import os
import pty
import select
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.configs import REPO, host, median_spread, run_tool  # noqa: E402
from bench.sample_speed import PROMPT  # noqa: E402
from runtime.checkpoint import existing_checkpoint  # noqa: E402
from runtime.errors import OneLineErrorParser, positive_int  # noqa: E402

BANNER = b"type a line"  # how --interactive's banner begins (sampling/output.py)


def past_prompt(seen: bytes) -> bool:
    return len(seen) > len(PROMPT)


def seconds_to_output(command: list[str], env: dict, done, on_stderr: bool = False) -> float:
    """Seconds from starting command until done(what its terminal showed) (on_stderr: its standard error's
    terminal); the process is then stopped."""
    controller, terminal = pty.openpty()
    start = time.perf_counter()
    process = subprocess.Popen(command, stdin=subprocess.DEVNULL, env=env,
                               stdout=subprocess.DEVNULL if on_stderr else terminal,
                               stderr=terminal if on_stderr else subprocess.DEVNULL)
    os.close(terminal)
    seen = b""
    try:
        while not done(seen):
            if not select.select([controller], [], [], 120)[0]:
                raise RuntimeError(f"no output within 120 s from {' '.join(command)}")
            try:
                chunk = os.read(controller, 4096)
            except OSError:  # the process ended: its terminal closed
                chunk = b""
            if not chunk:
                raise RuntimeError(f"{' '.join(command)} ended after {seen!r}")
            seen += chunk.replace(b"\r\n", b"\n")
        return time.perf_counter() - start
    finally:
        process.kill()
        process.wait()
        os.close(controller)


def main() -> None:
    parser = OneLineErrorParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", type=existing_checkpoint, required=True, help="a run folder or checkpoint file")
    parser.add_argument("--repeats", type=positive_int, default=5)
    parser.add_argument("--threads", type=positive_int, default=None,
                        help="passed to sample.py; by default it times its thread counts itself")
    parser.add_argument("--compile", action="store_true", help="also time decoding through a kept compiled step")
    args = parser.parse_args()
    checkpoint = args.checkpoint
    sample = [sys.executable, str(REPO / "sample.py"), "--checkpoint", str(checkpoint), "--device", "cpu",
              *(["--threads", str(args.threads)] if args.threads else [])]
    with tempfile.TemporaryDirectory() as steps:
        env = {**os.environ, "KVGPT_CACHE_DIR": steps}
        kinds = {
            "import torch (the floor)": ([sys.executable, "-c", "import torch; print('x')"], bool, False),
            "first character (eager)": ([*sample, "--no-compile", "--prompt", PROMPT], past_prompt, False),
            "--interactive's banner": ([*sample, "--no-compile", "--interactive"], lambda seen: BANNER in seen, True),
        }
        if args.compile:
            subprocess.run([*sample, "--compile", "--max-new-tokens", "1"], env=env, check=True,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            kinds["first character (kept compiled step)"] = ([*sample, "--prompt", PROMPT], past_prompt, False)
        times = {kind: [] for kind in kinds}
        for repeat in range(args.repeats + 1):
            for kind, (command, done, on_stderr) in kinds.items():
                seconds = seconds_to_output(command, env, done, on_stderr)
                if repeat:
                    times[kind].append(seconds)
    print(f"{host()}; {checkpoint}; median (min-max) of {args.repeats}, seconds from the command")
    print("| what a user waits for | seconds |")
    print("|---|---|")
    for kind, values in times.items():
        print(f"| {kind} | {median_spread(values)} |")


if __name__ == "__main__":
    run_tool(main)
