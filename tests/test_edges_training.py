"""train.py given a runs_dir that names no folder: one line, status 2, nothing written."""

import pytest

import corpus
from programs import SHORT, assert_one_line_error, train_cli
from test_train import TINY


@pytest.mark.parametrize("runs_dir, fragment", [("", "runs_dir='' names no folder"),
                                                (" ", "names no folder")])  # Hydra strips the blank
def test_a_runs_dir_that_names_no_folder_is_refused_before_anything_is_written(tmp_path, runs_dir, fragment):
    text = corpus.write_corpus(tmp_path / "source" / "text.txt")
    (tmp_path / "afile").write_text("kept")
    result = train_cli(*TINY, *SHORT, f"data.text={text}", f"data.root={tmp_path / 'data'}", f"runs_dir={runs_dir}",
                       cwd=tmp_path)
    assert_one_line_error(result, "train.py", fragment)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "source"]
    assert (tmp_path / "afile").read_text() == "kept" and result.stdout == ""
