"""Whether requirements.txt's packages are installed, asked before an entry point imports them: a command run
outside the project's venv says so in one line, instead of a traceback. Standard library only."""

import importlib.util
import sys

REQUIRED = ("torch", "numpy", "tqdm", "tensorboard", "hydra")  # requirements.txt's packages, as they are imported
DECODING = REQUIRED[:3]  # those that sample.py, serve.py and export.py import


def require_installed(command: str, modules: tuple[str, ...] = REQUIRED) -> None:
    """Exit with status 2 and one line on stderr unless every one of the modules can be imported."""
    missing = [name for name in modules if importlib.util.find_spec(name) is None]
    if missing:
        sys.stderr.write(f"{command}: error: {', '.join(missing)} not installed for {sys.executable}: activate the "
                         f"project's venv (. .venv/bin/activate), or set one up with README.md's first command\n")
        raise SystemExit(2)
