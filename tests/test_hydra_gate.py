"""training/hydra_gate.py: each refusal of a Hydra flag or setting, as train.py's command line meets it, and the
flags it reads, as Hydra's own."""

import logging
import re

import pytest

from programs import assert_one_line_error, train_cli
from training.hydra_gate import HYDRA_FLAGS, REFUSALS, RaisingHandler, info_written, read_flags


@pytest.mark.parametrize("refusal", REFUSALS, ids=[" ".join(refusal.example) for refusal in REFUSALS])
def test_each_refusal_is_its_own_line_with_status_2_before_anything_is_written(tmp_path, refusal):
    """Hydra ignored some of these (the run trained, into another folder than the one named), and refused the
    others with status 1, a warning or a traceback, as if the machine had failed."""
    result = train_cli(*refusal.example, cwd=tmp_path, timeout=120)
    line = assert_one_line_error(result, "train.py")
    assert any(name in line for name in refusal.what.split(", ")), line  # it names what it refuses
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


def test_info_changes_hydras_logger_alone_and_for_its_length_alone(capsys):
    """--info's text goes through a RaisingHandler on Hydra's logger, and no further, while --info runs: the root
    logger and logging's classes stay as they were, and Hydra's logger is again as it was once --info ends, however
    it ends."""
    hydra_logger, root = logging.getLogger("hydra"), logging.getLogger()
    before = list(hydra_logger.handlers), hydra_logger.propagate, list(root.handlers), logging.Handler.handleError
    with pytest.raises(KeyError):
        with info_written(read_flags(["--info"])):
            assert [type(handler) for handler in hydra_logger.handlers] == [*map(type, before[0]), RaisingHandler]
            logging.getLogger("hydra._internal.hydra").warning("written")
            assert capsys.readouterr().out == "written\n" and not hydra_logger.propagate
            raise KeyError("--info ended by an error")
    assert (list(hydra_logger.handlers), hydra_logger.propagate, list(root.handlers),
            logging.Handler.handleError) == before
