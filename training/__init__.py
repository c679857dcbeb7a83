"""Training and run machinery for kvgpt: typed settings, the loop, checkpoints, logging and run plumbing."""
