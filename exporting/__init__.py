"""export.py's room: a checkpoint as a transformers folder (hf.py, tokenizer.py, card.py) or an ONNX decoder with
its KV cache (onnx.py), written all at once by folder.py. hf.py also reads a folder back, for sample.py.
transformers, safetensors and onnx are imported only where they are used: kvgpt runs without them."""
