"""train.py's flags at their edges: --info's text where it cannot be written, and flags that cannot go together."""

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


@pytest.mark.parametrize("flags, fragments", [
    (["-p", "train", "train.max_iters=1"], ["--package applies to --cfg"]),  # it trained a whole run
    (["--resolve"], ["--resolve applies to --cfg and --help"]),
    (["-m", "train.max_iters=3", "--cfg", "job"], ["--multirun and --cfg cannot go together"]),
    (["--run", "-m"], ["--run and --multirun cannot go together"]),
    (["--shell-completion"], ["--shell-completion takes one of install=SHELL", "got none"]),
    (["--cfg", "job", "-p", "nonexist"], ["--package nonexist names nothing the --cfg job config shows"]),
    (["--experimental-rerun", "x.pickle"], ["train.py never saves", "train.resume=RUN"]),
])
def test_flags_that_cannot_apply_or_go_together_are_one_line_with_status_2(tmp_path, flags, fragments):
    """Hydra ignored some of these, and refused the others with status 1 or a warning, as if the machine failed."""
    result = subprocess.run([sys.executable, str(REPO / "train.py"), *flags], cwd=tmp_path, env=ENV,
                            capture_output=True, text=True, timeout=120)
    assert_one_line_error(result, "train.py", *fragments)
    assert result.stdout == "" and list(tmp_path.iterdir()) == []


def test_package_and_resolve_still_show_part_of_the_config(tmp_path):
    result = subprocess.run([sys.executable, str(REPO / "train.py"), "--cfg", "job", "--resolve", "-p", "train"],
                            cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stderr == "", result.stderr
    assert result.stdout.startswith("# @package train\n") and "max_iters:" in result.stdout
