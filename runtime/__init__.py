"""What the entry points stand on: whether their packages are installed (installed.py), the device and its
threads, the checkpoint format (and a transformers folder's, hf.py and tokenizer.py, which export.py writes and
sample.py reads back), atomic files, the standard streams, and how every command ends (command.py: run_command; one
line, an exit status). Knows nothing of hydra, training loops or TensorBoard."""
