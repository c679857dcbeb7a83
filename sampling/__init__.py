"""What sample.py stands on: its options and their checks, what it sets up before decoding (setup), its four ways
to decode (modes), how it writes text, saved sessions, and compiled decoding steps kept on disk. Knows nothing of
training."""
