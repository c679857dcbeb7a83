"""Which checkpoints train.resume continues: only the run's own, on the same text, with the same model settings."""

from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

import corpus
import train
from test_train import TINY, config, data_overrides
from runtime.checkpoint import save_checkpoint
from training.config import ConfigError
from programs import REPO, SHORT, assert_one_line_error, data_root, short_run, train_cli, tree

pytestmark = pytest.mark.slow  # through the commands, end to end: python -m pytest -m slow


@pytest.fixture(scope="module")
def stopped_runs(tmp_path_factory, data_root) -> list[Path]:
    """Two runs as if stopped at step 2 of 4, last.pt and best.pt both holding step 2."""
    tmp_path = tmp_path_factory.mktemp("stopped")
    run_dirs = [tmp_path / "runs/a", tmp_path / "runs/b"]
    for run_dir in run_dirs:
        train.main(config(tmp_path, data_root, *SHORT), run_dir)
        last = torch.load(run_dir / "last.pt", weights_only=True)
        last["training"]["step"] = 2
        for name in ("last.pt", "best.pt"):
            save_checkpoint(last, run_dir / name)
    return run_dirs


def copy_run(run_dir: Path, to: Path) -> Path:
    to.mkdir(parents=True)
    for path in run_dir.iterdir():
        (to / path.name).write_bytes(path.read_bytes())
    return to


def resume_checkpoint_elsewhere(keep: Path, other: Path) -> str:  # keep/snapshot.pt: a copy of another run's
    (keep / "snapshot.pt").write_bytes((other / "last.pt").read_bytes())
    return "keep/snapshot.pt"


def replace_last_pt(keep: Path, other: Path) -> str:
    (keep / "last.pt").write_bytes((other / "last.pt").read_bytes())
    return "keep"


def resume_best_pt_before_a_newer_last_pt(keep: Path, other: Path) -> str:
    last = torch.load(keep / "last.pt", weights_only=True)
    last["training"]["step"] = 3
    save_checkpoint(last, keep / "last.pt")
    return "keep/best.pt"


def forget_the_run_identity(keep: Path, other: Path) -> str:  # as an earlier version wrote it
    for name in ("last.pt", "best.pt"):
        contents = torch.load(keep / name, weights_only=True)
        del contents["training"]["run_id"]
        save_checkpoint(contents, keep / name)
    return "./keep/../keep"


@pytest.mark.parametrize("case, reason", [
    (resume_checkpoint_elsewhere, "snapshot.pt is not a run's last.pt or best.pt"),
    (replace_last_pt, "its best.pt is another run's"),
    (resume_best_pt_before_a_newer_last_pt, "its last.pt is newer); resume from keep/last.pt, or"),
    (forget_the_run_identity, "the checkpoint records no run identity"),
], ids=lambda case: getattr(case, "__name__", ""))
def test_a_resume_is_refused_where_the_checkpoint_is_not_provably_the_runs_own(tmp_path, data_root, stopped_runs,
                                                                               case, reason):
    keep = copy_run(stopped_runs[0], tmp_path / "keep")
    resume = case(keep, stopped_runs[1])
    before = tree(keep)
    result = train_cli(*TINY, *SHORT, *data_overrides(data_root), f"train.resume={resume}", cwd=tmp_path)
    run_dir = Path(resume).parent if resume.endswith(".pt") else Path(resume)
    assert_one_line_error(result, "train.py", f"train.resume: {run_dir} is not provably the run of", reason,
                          "continue in a new directory with hydra.run.dir=NEW")
    assert tree(keep) == before
    assert not (tmp_path / "runs").exists() or list((tmp_path / "runs").iterdir()) == []


def test_a_resume_continues_in_its_own_run_however_the_path_is_written(tmp_path, data_root, stopped_runs):
    run = copy_run(stopped_runs[0], tmp_path / "run")
    (tmp_path / "link").symlink_to(run)
    result = train_cli(*TINY, *SHORT, *data_overrides(data_root), "train.resume=./link/../run/last.pt",
                       "hydra.run.dir=link", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    last, best = (torch.load(run / name, weights_only=True)["training"] for name in ("last.pt", "best.pt"))
    assert last["step"] == 4 and last["run_id"] == best["run_id"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link", "run"]


def test_resuming_on_another_text_is_refused(tmp_path, data_root, short_run):
    other = tmp_path / "other.txt"
    other.write_text(corpus.TEXT.swapcase(), encoding="utf-8")  # the same characters, another text
    with initialize_config_dir(str(REPO / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=[*TINY, f"data.text={other}", f"data.root={data_root}",
                                           f"runs_dir={tmp_path / 'runs'}", *SHORT,
                                           f"train.resume={short_run}"])
    with pytest.raises(ConfigError, match=rf"^train.resume: the checkpoint was trained on .*corpus.txt \(sha256 "
                                          rf"{corpus.SHA256[:12]}\), not on {other}; resume with the text"):
        train.main(cfg, tmp_path / "runs/resumed")


@pytest.mark.parametrize("design", [["model.n_kv_head=1"], ["model.kv_share=2"],
                                    ["model.n_kv_head=1", "model.kv_share=2"], ["model.learned_sink=true"],
                                    ["model.kv_latent=8"]])
def test_resuming_a_checkpoint_older_than_the_cache_designs_with_another_design_is_one_line(tmp_path, data_root,
                                                                                         short_run, design):
    """A checkpoint saved before the cache designs existed holds multi-head attention with every layer its own
    keys and values: another design is refused with the settings to add, as for a newer checkpoint."""
    old = torch.load(short_run / "last.pt", weights_only=True)
    for section in (old["model_config"], old["training"]["config"]["model"]):
        for field in ("n_kv_head", "kv_share", "window_pattern", "local_window", "learned_sink", "kv_latent",
                      "kv_latent_rope"):
            del section[field]
    path = tmp_path / "old.pt"
    save_checkpoint(old, path)
    n_head = old["model_config"]["n_head"]
    with pytest.raises(ConfigError, match=r"^train.resume continues a run with other settings; add them to the "
                                          r"command: .*model\.(n_kv_head|kv_share|learned_sink|kv_latent)="):
        train.main(config(tmp_path, data_root, *SHORT, *design, f"train.resume={path}"), tmp_path / "runs/resumed")
    assert train.main(config(tmp_path, data_root, *SHORT, f"model.n_kv_head={n_head}", "model.kv_share=1",
                             f"train.resume={path}"), tmp_path / "runs/same") is not None  # the same design resumes
