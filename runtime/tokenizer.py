"""A character tokenizer that transformers' AutoTokenizer loads: one token per character, ids as kvgpt's.

tokenizer.json holds a BPE model with no merges, so a text splits into its characters, each its own token. No
normaliser, pre-tokeniser or added prefix touches the text, and the Fuse decoder joins the tokens with nothing
between them: every text of the vocabulary, spaces and newlines included, encodes to kvgpt's ids and decodes back
exactly. The vocabulary has no unknown token: the tokenizer drops a character outside it, so check a prompt's
characters first where that matters.

CTranslate2 needs bos, eos and unk named, and its converter refuses a tokenizer larger than the model's logits. A
token added for them (transformers adds any it does not find) would be one more, so all three name one of the
vocabulary's characters (special_token): the one the training text holds least often, which the model is least
likely to write. Engines that end the text at eos (CTranslate2, vLLM) or leave special tokens out of it (the
pipeline) then change kvgpt's text only where it holds that character (docs/export.md)."""

import json
from pathlib import Path

from data import CharVocab

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def tokenizer_json(vocab: CharVocab) -> dict:
    """The tokenizers library's serialisation of the character tokenizer for vocab."""
    return {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": [],
        "normalizer": None, "pre_tokenizer": None, "post_processor": None,
        "decoder": {"type": "Fuse"},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": {c: i for i, c in enumerate(vocab.chars)}, "merges": []},
    }


def special_token(vocab: CharVocab, counts: list[int] | None) -> str:
    """The character named bos, eos and unk: of counts (how often the training text holds each character, in id
    order), the least frequent, the lowest id among equals. Without counts, the vocabulary's last character: the
    highest code point, which is never the newline or the space in a text that has letters."""
    if counts is None:
        return vocab.chars[-1]
    return vocab.chars[min(range(len(vocab)), key=lambda i: (counts[i], i))]


def tokenizer_config(special: str) -> dict:
    """What AutoTokenizer reads first: the fast tokenizer of tokenizer.json, which leaves spaces as they are, with
    the character special_token chose as bos, eos and unk."""
    return {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False,
            "model_input_names": ["input_ids", "attention_mask"],
            "bos_token": special, "eos_token": special, "unk_token": special}


def write_tokenizer(vocab: CharVocab, special: str, folder: Path) -> None:
    """Write tokenizer.json and tokenizer_config.json into folder, special named bos, eos and unk."""
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer_json(vocab), ensure_ascii=False, indent=1) + "\n",
                                           encoding="utf-8")
    config = json.dumps(tokenizer_config(special), ensure_ascii=False, indent=1)
    (folder / "tokenizer_config.json").write_text(config + "\n", encoding="utf-8")


def read_vocab(folder: Path) -> CharVocab:
    """The character vocabulary of a tokenizer.json that write_tokenizer wrote, in id order."""
    model = json.loads((Path(folder) / "tokenizer.json").read_text(encoding="utf-8"))["model"]
    by_id = sorted((i, c) for c, i in model["vocab"].items())
    if [i for i, _ in by_id] != list(range(len(by_id))) or any(len(c) != 1 for _, c in by_id) or model["merges"]:
        raise ValueError("tokenizer.json is not a character tokenizer with ids 0, 1, 2, ...")
    return CharVocab("".join(c for _, c in by_id))
