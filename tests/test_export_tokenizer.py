"""The exported tokenizer's bos, eos and unk: the character the training text holds least often, which the model is
least likely to write, so that engines that stop at eos or leave special tokens out keep kvgpt's text."""

from collections import Counter

import pytest

transformers = pytest.importorskip("transformers")  # requirements-dev.txt installs it; kvgpt runs without it

import export as export_py  # noqa: E402
from data import VAL_FRACTION, prepare_text  # noqa: E402
from exporting.folder import export  # noqa: E402
from runtime.checkpoint import build_checkpoint, save_checkpoint  # noqa: E402
from runtime.tokenizer import special_token  # noqa: E402
from test_export import VOCAB  # noqa: E402
from tiny_models import random_model  # noqa: E402

# every character of VOCAB; '!' once, in the training split, newlines and spaces on every line
TEXT = "ab ba\nhij  ajb\ncdefg hij\n" * 8 + "!\n" + "ab ba\n" * 4
NEWLINES = "ab ba\n\nhij  \n ihg fedcba\n\n"


def test_the_tokenizer_names_the_training_texts_rarest_character_and_keeps_newlines(tmp_path):
    (tmp_path / "notes.txt").write_text(TEXT, encoding="utf-8")
    prepared = prepare_text(tmp_path / "notes.txt", tmp_path / "datasets")
    counts = Counter(TEXT[:int(len(TEXT) * (1 - VAL_FRACTION))])  # the training split, as prepare_text cuts it
    assert prepared.vocab == VOCAB and min(VOCAB.chars, key=lambda c: counts[c]) == "!" and counts["!"] == 1
    save_checkpoint(build_checkpoint(random_model(), VOCAB, text=prepared), tmp_path / "best.pt")
    tokenizer = transformers.AutoTokenizer.from_pretrained(export(tmp_path, tmp_path / "hf"))
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.unk_token) == ("!",) * 3
    assert len(tokenizer) == len(VOCAB)  # no id added: every id a character, the logits kvgpt's
    ids = tokenizer(NEWLINES).input_ids
    assert ids == VOCAB.encode(NEWLINES) and tokenizer.decode(ids, skip_special_tokens=True) == NEWLINES


def test_the_rarest_character_of_equals_is_the_lowest_id_and_without_counts_the_last():
    assert special_token(VOCAB, [5] * len(VOCAB)) == VOCAB.chars[0]
    assert special_token(VOCAB, [3, 9, 9, 1, 4, 1, 7, 2, 2, 8, 6, 5, 1]) == VOCAB.chars[3]
    assert special_token(VOCAB, None) == VOCAB.chars[-1] == "j"


def test_a_checkpoint_that_records_no_counts_exports_with_one_warning_naming_its_character(tmp_path, capsys):
    save_checkpoint(build_checkpoint(random_model(), VOCAB), tmp_path / "best.pt")
    export_py.main(["--checkpoint", str(tmp_path), str(tmp_path / "hf")])
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("export.py: warning: "), err
    assert "records no character counts" in err and "'j'" in err, err
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.unk_token) == ("j",) * 3
