"""train.py's flags at their edges: --info's text where it cannot be written, and --package and --resolve where they
apply (tests/test_hydra_gate.py: where they cannot)."""

import subprocess
import sys
from pathlib import Path

import pytest

from programs import ENV, REPO, assert_one_line_error


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
@pytest.mark.parametrize("flags", [["--info"], ["--info", "config"]])
def test_info_on_a_full_disk_is_one_line_with_status_1(tmp_path, flags):
    """Hydra writes --info through logging, which printed a traceback for each line and exited 0."""
    with open("/dev/full", "w") as full:
        result = subprocess.run([sys.executable, str(REPO / "train.py"), *flags], cwd=tmp_path, env=ENV, stdout=full,
                                stderr=subprocess.PIPE, text=True, timeout=120)
    assert_one_line_error(result, "train.py", "cannot write to standard output (No space left on device)", status=1)


@pytest.mark.parametrize("flags", [["--info"], ["--info", "all"]])
def test_info_to_a_reader_that_stops_early_ends_quietly(tmp_path, flags):
    """As `--help | head` does: nothing more was wanted."""
    process = subprocess.Popen([sys.executable, str(REPO / "train.py"), *flags], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, env=ENV, cwd=tmp_path)
    process.stdout.close()  # the reader is gone before the first line
    stderr = process.stderr.read().decode()
    process.stderr.close()
    assert process.wait(timeout=120) == 0 and stderr == "", stderr


def test_package_and_resolve_still_show_part_of_the_config(tmp_path):
    result = subprocess.run([sys.executable, str(REPO / "train.py"), "--cfg", "job", "--resolve", "-p", "train"],
                            cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stderr == "", result.stderr
    assert result.stdout.startswith("# @package train\n") and "max_iters:" in result.stdout
