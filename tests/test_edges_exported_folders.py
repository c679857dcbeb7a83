"""Edges of exported folders read back: a folder is checked whole when it is loaded, so that a damaged tokenizer or
config is refused in one line before any output, never found midway; and train.resume given one, or any file of
weights alone, says at once that it cannot be resumed and what to do instead."""

import json
import shutil
import subprocess

import pytest

pytest.importorskip("transformers")  # export writes config.json with it

from exporting.folder import export  # noqa: E402
from programs import (ENV, assert_one_line_error, checkpoint, data_root, sample_command,  # noqa: E402,F401
                      short_run, train_cli)
from runtime.checkpoint import (build_checkpoint, layout_damage, load_checkpoint, load_model,  # noqa: E402
                                save_checkpoint)
from runtime.errors import CheckpointError  # noqa: E402
from runtime.hf import SOURCE_KEY  # noqa: E402
from test_export import TRAINED_ON, VOCAB  # noqa: E402
from test_train import TINY, data_overrides  # noqa: E402
from tiny_models import random_model  # noqa: E402
from training.runs import weights_only  # noqa: E402

DAMAGED = "is no folder that export.py wrote, or is damaged ("
AGAIN = "); export the checkpoint again"


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    run = tmp_path_factory.mktemp("run")
    save_checkpoint(build_checkpoint(random_model(), VOCAB), run / "best.pt")
    return export(run, run / "hf")


def test_a_folder_reads_back_in_the_layout_of_the_checkpoint_it_was_exported_from(tmp_path):
    """One layout for every checkpoint: a folder read back holds the entries of the checkpoint it came from, the
    text it was trained on and its characters' counts recorded alike (all-zero biases read back as none: the same
    function)."""
    (tmp_path / "run").mkdir()
    contents = build_checkpoint(random_model(), VOCAB, text=TRAINED_ON)
    save_checkpoint(contents, tmp_path / "run" / "best.pt")
    back = load_checkpoint(export(tmp_path / "run", tmp_path / "hf"))
    assert layout_damage(back) is None and back.keys() == contents.keys()
    assert [back[key] for key in ("format", "version", "vocab", "text")] == \
        [contents[key] for key in ("format", "version", "vocab", "text")]
    assert {**back["model_config"], "bias": True} == contents["model_config"]


def damaged_copy(exported, to, name: str, change) -> None:
    """A copy of the exported folder with name's JSON changed in place by change(its contents)."""
    shutil.copytree(exported, to)
    contents = json.loads((to / name).read_text(encoding="utf-8"))
    (to / name).write_text(json.dumps(change(contents), ensure_ascii=False), encoding="utf-8")


def without_last_character(tokenizer: dict) -> dict:
    vocab = tokenizer["model"]["vocab"]
    del vocab[max(vocab, key=vocab.get)]
    return tokenizer


def test_a_tokenizer_one_character_short_is_refused_before_any_output(exported, tmp_path):
    """The model could draw the id with no character: found as the text was written, 129 bytes in."""
    folder = tmp_path / "hf"
    damaged_copy(exported, folder, "tokenizer.json", without_last_character)
    result = subprocess.run(sample_command(folder, "--max-new-tokens", "200", "--seed", "1"), env=ENV,
                            capture_output=True, text=True, timeout=120)
    assert_one_line_error(result, "sample.py", f"{folder} {DAMAGED}ValueError: tokenizer.json holds 12 characters, "
                                               f"config.json's vocab_size is 13{AGAIN}")
    assert result.stdout == ""


def one_character_more(tokenizer: dict) -> dict:
    tokenizer["model"]["vocab"]["z"] = len(tokenizer["model"]["vocab"])
    return tokenizer


@pytest.mark.parametrize("name, change, fragment", [
    ("tokenizer.json", one_character_more, "tokenizer.json holds 14 characters, config.json's vocab_size is 13"),
    ("config.json", lambda config: {**config, "vocab_size": 12}, "tokenizer.json holds 13 characters, config.json's "
                                                                 "vocab_size is 12"),
    ("generation_config.json", lambda config: [config], "generation_config.json holds no JSON object"),
    ("tokenizer_config.json", lambda config: "PreTrainedTokenizerFast", "tokenizer_config.json holds no JSON object"),
])
def test_a_folder_whose_files_disagree_or_are_damaged_is_refused_when_loaded(exported, tmp_path, name, change,
                                                                            fragment):
    folder = tmp_path / "hf"
    damaged_copy(exported, folder, name, change)
    with pytest.raises(CheckpointError) as error:
        load_model(folder)
    assert str(error.value).startswith(f"{folder} {DAMAGED}ValueError: {fragment}{AGAIN}")


def test_weights_of_another_shape_are_a_damaged_folder_not_another_version(exported, tmp_path):
    """config.json and model.safetensors disagree: the folder is damaged, and exporting again mends it."""
    from safetensors.torch import load_file, save_file
    folder = tmp_path / "hf"
    shutil.copytree(exported, folder)
    tensors = load_file(folder / "model.safetensors")
    tensors["transformer.h.0.mlp.c_proj.weight"] = tensors["transformer.h.0.mlp.c_proj.weight"][:-1]
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError) as error:
        load_model(folder)
    message = str(error.value)
    assert message.startswith(f"{folder} {DAMAGED}RuntimeError: ") and message.endswith(AGAIN), message
    assert "size mismatch for blocks.0.mlp.proj.weight" in message and "version" not in message


@pytest.mark.parametrize("counts, fragment", [
    ("[1, 2]", "ValueError: text's char_counts are not one count per character"),
    ("[1, 2", "JSONDecodeError: "),
])
def test_character_counts_damaged_in_the_metadata_are_a_damaged_folder(tmp_path, counts, fragment):
    """The counts choose the bos, eos and unk of a folder exported from this one: damaged, they are refused."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file
    (tmp_path / "run").mkdir()
    save_checkpoint(build_checkpoint(random_model(), VOCAB, text=TRAINED_ON), tmp_path / "run" / "best.pt")
    folder = export(tmp_path / "run", tmp_path / "hf")
    with safe_open(folder / "model.safetensors", framework="pt") as f:
        metadata = f.metadata()
    tensors = load_file(folder / "model.safetensors")
    save_file(tensors, folder / "model.safetensors", metadata={**metadata, "data_char_counts": counts})
    with pytest.raises(CheckpointError) as error:
        load_model(folder)
    assert str(error.value).startswith(f"{folder} {DAMAGED}{fragment}") and str(error.value).endswith(AGAIN)


WEIGHTS_ALONE = "holds the weights alone, no optimiser state or step to continue: "
RESUME_ADVICE = f"{WEIGHTS_ALONE}resume from the last.pt of the run that trained it, or train anew without train.resume"


def test_resuming_an_exported_folder_says_at_once_that_it_cannot_be_resumed(tmp_path, data_root, short_run):
    """Resumed where it lies, the folder's parent was taken for its run directory and refused as another's, with
    advice (hydra.run.dir=NEW) that led only to a second refusal. Exported from the run's best.pt, it names both
    of the run's checkpoints: each continues it, from its own step."""
    folder = export(short_run, tmp_path / "hf")
    best, last = short_run.resolve() / "best.pt", short_run.resolve() / "last.pt"
    for elsewhere in ((), (f"hydra.run.dir={tmp_path / 'new'}",)):
        result = train_cli(*TINY, *data_overrides(data_root), f"train.resume={folder}", *elsewhere, cwd=tmp_path,
                           timeout=120)
        assert_one_line_error(result, "train.py", f"train.resume: {folder} is a folder that export.py wrote, which "
                                                  f"{WEIGHTS_ALONE}it was exported from {best}: train.resume={last} "
                                                  f"continues the run from its latest step, or train.resume={best} "
                                                  f"hydra.run.dir=NEW a run of its own from best.pt's step")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


def without_its_source(folder):
    """The folder as export.py wrote it before exports recorded the checkpoint they came from."""
    from safetensors.torch import load_file, save_file
    from safetensors import safe_open
    with safe_open(folder / "model.safetensors", framework="pt") as f:
        metadata = {key: value for key, value in f.metadata().items() if key != SOURCE_KEY}
    save_file(load_file(folder / "model.safetensors"), folder / "model.safetensors", metadata=metadata)


@pytest.mark.parametrize("source, advice", [
    ("last.pt", "it was exported from SOURCE: resume from that, train.resume=SOURCE"),
    ("best.pt alone", "it was exported from SOURCE: resume from that, train.resume=SOURCE"),
    ("removed", "it was exported from SOURCE, which is no longer there, and kvgpt starts no run from weights alone: "
                "train anew without train.resume"),
    ("not recorded", "it records no checkpoint it came from; resume from the last.pt of the run that trained it, or "
                     "train anew without train.resume")])
def test_an_exported_folder_refused_for_resuming_says_what_it_knows_of_its_checkpoint(tmp_path, short_run, source,
                                                                                       advice):
    """The advice named "the last.pt of the run that trained it" whatever the folder came from: a best.pt, or a
    run no longer there."""
    run = tmp_path / "run"
    run.mkdir()
    exported_from = run / ("last.pt" if source == "last.pt" else "best.pt")
    shutil.copy(short_run / exported_from.name, exported_from)
    folder = export(exported_from, tmp_path / "hf")
    if source == "removed":
        shutil.rmtree(run)
    if source == "not recorded":
        without_its_source(folder)
    message = str(weights_only(folder))
    assert message == (f"train.resume: {folder} is a folder that export.py wrote, which {WEIGHTS_ALONE}"
                       f"{advice.replace('SOURCE', str(exported_from.resolve()))}")


def test_resuming_a_checkpoint_of_weights_alone_says_so_not_that_an_earlier_version_wrote_it(tmp_path, data_root,
                                                                                          checkpoint):
    result = train_cli(*TINY, *data_overrides(data_root), f"train.resume={checkpoint}", cwd=tmp_path, timeout=120)
    assert_one_line_error(result, "train.py", f"train.resume: {checkpoint} is a checkpoint that {RESUME_ADVICE}")
    assert list(tmp_path.iterdir()) == []
