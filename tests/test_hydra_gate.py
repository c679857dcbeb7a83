"""training/hydra_gate.py: each refusal of a Hydra flag or setting, as train.py's command line meets it, and the
flags it reads, as Hydra's own."""

import re

import pytest

from programs import assert_one_line_error, train_cli
from training.hydra_gate import HYDRA_FLAGS, REFUSALS


@pytest.mark.parametrize("refusal", REFUSALS, ids=[" ".join(refusal.example) for refusal in REFUSALS])
def test_each_refusal_is_its_own_line_with_status_2_before_anything_is_written(tmp_path, refusal):
    """Hydra ignored some of these (the run trained, into another folder than the one named), and refused the
    others with status 1, a warning or a traceback, as if the machine had failed."""
    result = train_cli(*refusal.example, cwd=tmp_path, timeout=120)
    line = assert_one_line_error(result, "train.py", refusal.what.split(",")[0])
    for words in re.split(r"\{\w+\}", refusal.says):  # the row's own words, around the facts it fills in
        assert words in line, (words, line)
    assert result.stdout == "" and list(tmp_path.iterdir()) == []


def test_the_flags_read_are_hydras_own(tmp_path):
    """read_flags reads the flags before Hydra does, with a table of its own: the flags Hydra lists are the same,
    or one would be refused as unrecognised, or taken for an override."""
    result = train_cli("--hydra-help", cwd=tmp_path, timeout=120)
    assert result.returncode == 0, result.stderr
    listed = {tuple(line.split(" : ")[0].split(",")) for line in result.stdout.splitlines() if line.startswith("-")}
    assert listed == {names for names, _ in HYDRA_FLAGS}
