"""The exported folder's model card (README.md) and generation_config.json: what the model is, what it was trained
on, how far it was trained, and how to load it."""

import json

from runtime.hf import CLASSES, rolls


def facts(contents: dict) -> dict[str, str]:
    """What a checkpoint records of its training, as strings (model.safetensors' metadata holds them too)."""
    text, training = contents.get("text") or {}, contents.get("training") or {}
    loss = training.get("best_val_loss")
    counts = text.get("char_counts")
    return {"data": text.get("source", "not recorded"), "data_sha256": text.get("sha256", ""),
            "data_char_counts": json.dumps(counts) if counts is not None else "",
            "steps": str(training["step"]) if "step" in training else "not recorded",
            "best_val_loss": f"{loss:.4f}" if isinstance(loss, float) else "not recorded"}


def design(config) -> str:
    positions = "learned positions" if config.pos_emb == "learned" else "rotary positions"
    heads = ("multi-head" if config.n_kv_head == config.n_head else
             "multi-query" if config.n_kv_head == 1 else f"grouped-query ({config.n_kv_head} key/value heads)")
    return f"{positions}, {heads} attention"


def generation_config(config) -> dict:
    """Greedy by default up to block_size tokens, prompt included: kvgpt's text, token for token. Past it, only
    a design that rolls stays kvgpt's (docs/export.md)."""
    return {"do_sample": False, "max_length": config.block_size, "bos_token_id": None, "eos_token_id": None,
            "pad_token_id": None}


def model_card(config, kind: str, fmt: str, contents: dict, special: str | None) -> str:
    """README.md of an exported folder; special: the character its tokenizer names bos, eos and unk, if any."""
    f = facts(contents)
    c, sha = config, f" (sha256 {f['data_sha256'][:12]})" if f["data_sha256"] else ""
    engine = {"hf": "transformers", "onnx": "onnxruntime", "gguf": "llama.cpp"}[fmt]
    past = (f"In {engine} learned positions stop at block_size; kvgpt's sample.py refills its context there."
            if c.pos_emb == "learned" else
            "Past block_size it keeps a sliding window of block_size tokens, as kvgpt does."
            if (rolls(c) and fmt == "hf") or fmt == "onnx" else
            f"Past block_size {engine} attends every earlier token, where kvgpt sees the last block_size.")
    if fmt == "hf":
        use = (f"```python\nfrom transformers import AutoModelForCausalLM, AutoTokenizer\n"
               f"tokenizer = AutoTokenizer.from_pretrained(\"PATH\")\n"
               f"model = AutoModelForCausalLM.from_pretrained(\"PATH\")  # {CLASSES[kind][0]}\n"
               f"ids = tokenizer(\"ROMEO:\", return_tensors=\"pt\").input_ids\n"
               f"print(tokenizer.decode(model.generate(ids, max_new_tokens=100)[0]))\n```\n")
        head = "---\nlibrary_name: transformers\npipeline_tag: text-generation\n---\n\n"
    elif fmt == "gguf":
        use = ("```bash\nllama-completion -m PATH/model.gguf -p \"ROMEO:\" -n 100 --temp 0\n```\n"
               "The file names no end-of-text token, so no character ends llama.cpp's text "
               "(docs/export.md).\n")
        head = ""
    else:
        use = ("model.onnx takes input_ids, position_ids and each layer's past keys and values, and returns the "
               "logits and each layer's present keys and values. kvgpt's docs/export.md shows the loop.\n")
        head = ""
    named = f"; bos, eos and unk name {special!r} (docs/export.md)" if special is not None else ""
    close = " up to llama.cpp's arithmetic (docs/export.md)" if fmt == "gguf" else ""
    where = f"llama.cpp, {kind}" if fmt == "gguf" else f"transformers, {CLASSES[kind][0]}"
    return (f"{head}# A character-level GPT trained with kvgpt\n\n"
            f"- design: {design(c)}, {c.n_layer} layers, {c.n_head} heads, {c.n_embd} wide, "
            f"block_size {c.block_size}; in {where}\n"
            f"- data: {f['data']}{sha}\n"
            f"- training steps: {f['steps']}\n- best val loss: {f['best_val_loss']}\n"
            f"- tokenizer: one token per character, {c.vocab_size} characters{named}\n\n"
            f"Weights are float32 and give kvgpt's logits{close}. {past}\n\n{use}")
