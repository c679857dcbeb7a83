"""serve.py's parts: OpenAI's completions API over the engine (model/serving/engine.py), and a page of the pool."""
