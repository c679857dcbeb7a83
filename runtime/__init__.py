"""What the entry points stand on: the device and its threads, the checkpoint format, atomic files, and how an
error ends a command (one line, an exit status); sample.py's options and how it writes text. Knows nothing of
hydra, training loops or TensorBoard."""
