"""What both entry points stand on: the device and its threads, the checkpoint format, atomic files, and how an
error ends a command (one line, an exit status). Knows nothing of hydra, training loops or TensorBoard."""
