"""train.py given a runs_dir that names no folder, settings refused once its run directory is claimed, or settings
that cannot apply to the run: one line, status 2, nothing written or nothing left."""

import pytest

import corpus
from programs import SHORT, assert_one_line_error, data_root, short_run, train_cli
from test_train import TINY, data_overrides

pytestmark = pytest.mark.slow  # through the commands, end to end: python -m pytest -m slow


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


@pytest.mark.parametrize("refused, fragment", [(["optim.warmup_iters=30"], "optim.warmup_iters must be below"),
                                               (["data.text=missing.txt"], "missing.txt")])
def test_a_run_refused_after_its_directory_is_claimed_leaves_no_folder(tmp_path, refused, fragment):
    """The run directory and the runs_dir above it, made for the run, go again; a folder that was there stays."""
    (tmp_path / "kept").mkdir()
    result = train_cli(*TINY, *SHORT, f"data.root={tmp_path / 'data'}",
                       f"hydra.run.dir={tmp_path / 'kept/run'}" if refused[0].startswith("data") else
                       f"runs_dir={tmp_path / 'new/runs'}", *refused, cwd=tmp_path)
    assert_one_line_error(result, "train.py", fragment)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kept"] and not any((tmp_path / "kept").iterdir())


@pytest.mark.parametrize("empty, fragment", [("data.text=", "data.text must be a text file's path"),
                                             ("data.root=", "data.root must be a folder's path")])
def test_an_empty_data_path_is_refused_and_leaves_nothing(tmp_path, empty, fragment):
    """An empty path is the working folder: read as the text, it was 'the text . is not a regular file'."""
    result = train_cli(*TINY, *SHORT, f"runs_dir={tmp_path / 'runs'}", empty, cwd=tmp_path)
    assert_one_line_error(result, "train.py", fragment)
    assert list(tmp_path.iterdir()) == [] and result.stdout == ""


@pytest.mark.parametrize("named, fragment", [
    (["train.size_to_host=true"], "train.size_to_host=true cannot apply (train.max_iters names the steps)"),
    (["train.patience=2", "train.eval_interval=100"], "train.patience=2 can never end this run: it evaluates 0"),
])
def test_a_setting_that_cannot_apply_is_refused_and_leaves_nothing(tmp_path, data_root, named, fragment):
    """Each was ignored: the run trained, into a folder other than the one named, unsized, or to its end."""
    flags, overrides = [n for n in named if n.startswith("-")], [n for n in named if not n.startswith("-")]
    result = train_cli(*flags, *TINY, *SHORT, *data_overrides(data_root), *overrides, cwd=tmp_path)
    assert_one_line_error(result, "train.py", fragment)
    assert list(tmp_path.iterdir()) == []


def test_a_runs_dir_is_refused_where_a_resumed_run_goes_on_elsewhere(tmp_path, data_root, short_run):
    result = train_cli(*TINY, *SHORT, *data_overrides(data_root), f"train.resume={short_run}", "runs_dir=other",
                       cwd=tmp_path)
    assert_one_line_error(result, "train.py", "runs_dir=other cannot apply", f"in its own directory {short_run}")
    assert list(tmp_path.iterdir()) == []


def test_a_sweep_job_resumes_with_the_runs_dir_that_holds_it(tmp_path, data_root):
    """The sweep's command plus train.resume: its job lies deeper in runs_dir, under multirun/<date>/."""
    common = [*TINY, *SHORT, *data_overrides(data_root), "runs_dir=runs", "train.seed=1"]
    sweep = train_cli("-m", *common, cwd=tmp_path)
    assert sweep.returncode == 0, sweep.stderr
    job = next((tmp_path / "runs/multirun").glob("*/0"))
    result = train_cli(*common, f"train.resume={job}", "train.max_iters=6", cwd=tmp_path)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("override, fragment", [
    ("train.max_iters=1e3", "train.max_iters must be a whole number, got 1000.0 (write 1000)"),
    ("train.batch_size=1e9", "train.batch_size must be a whole number, got 1000000000.0 (write 1000000000)"),
    ("train.max_iters=1.5", "train.max_iters must be a whole number, got 1.5"),
])
def test_a_number_that_is_not_whole_says_so(tmp_path, override, fragment):
    """OmegaConf's own words were `Value '1000.0' of type 'float' could not be converted to Integer full_key: ...`."""
    result = train_cli(*TINY, override, cwd=tmp_path)
    assert assert_one_line_error(result, "train.py", fragment) == f"train.py: error: {fragment}"
    assert list(tmp_path.iterdir()) == []
