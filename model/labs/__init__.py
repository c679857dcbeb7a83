"""Labs: each module adds one idea to the core (model/attention.py, gpt.py, kv_cache.py) and reads as that addition."""
