"""export.py's room: a checkpoint as a transformers folder (its weights named by runtime/hf.py, its tokenizer by
runtime/tokenizer.py, its card by card.py) or an ONNX decoder with its KV cache (onnx.py), written all at once by
folder.py. transformers, safetensors and onnx are imported only where they are used: kvgpt runs without them."""
