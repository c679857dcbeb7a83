"""A command run outside the project's venv: one line that says what is missing and how to set up, status 2,
before any import that would end in a traceback."""

import re
import subprocess
import sys

import pytest

from programs import ENV, REPO, assert_one_line_error
from runtime.installed import DECODING, REQUIRED

IMPORTED_AS = {"hydra-core": "hydra"}  # the requirements whose module has another name


def test_the_packages_asked_for_are_requirements_txt_s():
    names = [re.split(r"[<>=#\s]", line, maxsplit=1)[0] for line in (REPO / "requirements.txt").read_text().splitlines()
             if line.strip() and not line.startswith("#")]
    assert tuple(IMPORTED_AS.get(name, name) for name in names) == REQUIRED
    assert set(DECODING) < set(REQUIRED)


@pytest.mark.parametrize("script", ["train.py", "sample.py", "serve.py", "export.py"])
def test_a_python_without_the_packages_is_told_how_to_set_up(script):
    """python -S leaves site-packages off the path: torch and the rest cannot be found, as outside the venv."""
    result = subprocess.run([sys.executable, "-S", script, "--help"], cwd=REPO, env=ENV, capture_output=True,
                            text=True, timeout=60)
    line = assert_one_line_error(result, script, "torch", sys.executable, ". .venv/bin/activate", "README.md")
    assert "hydra" in line if script == "train.py" else "hydra" not in line
    assert result.stdout == ""
