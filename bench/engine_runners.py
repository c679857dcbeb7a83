"""How each engine decodes kvgpt's model greedily, for bench/engines.py: kvgpt's own generate through its packed
compiled step, and each other engine from kvgpt's export. Each runs in a process of its own, so that no engine's
threads or libraries slow another's:

    python bench/engine_runners.py ENGINE SPEC

SPEC is JSON: the checkpoint and the folder its packed step is kept in, the exported hf folder and the onnx and
gguf models, the (prompts, new tokens) jobs, the repeats, the vocabulary's characters, block_size and the thread
count. A job's prompts are decoded at once, as one batch: all of one length, so that no engine needs padding. The
one line printed, `KVGPT {...}`, holds the engine's version, its setting (for an export, the one docs/export.md
names for kvgpt's text), its text for each prompt of each job and its best seconds on the first job, or its
error. vLLM's runs from the python of vLLM's own environment; it imports nothing of kvgpt's."""

import json
import os
import sys
import time
from pathlib import Path


def timed(run, jobs: list, repeats: int) -> tuple[list[str], float]:
    """(run's text for each prompt of each (prompts, n) job, the best seconds of the first job): one warm-up,
    repeats timed."""
    seconds = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        run(*jobs[0])
        seconds.append(time.perf_counter() - start)
    return [text for job in jobs for text in run(*job)], min(seconds[1:])


def transformers_engine(spec: dict):
    import torch
    import transformers
    torch.set_num_threads(spec["threads"])
    tokenizer = transformers.AutoTokenizer.from_pretrained(spec["hf"])
    model = transformers.AutoModelForCausalLM.from_pretrained(spec["hf"]).eval()

    def run(prompts: list[str], n: int) -> list[str]:
        ids = tokenizer(prompts, return_tensors="pt").input_ids
        with torch.no_grad():
            return tokenizer.batch_decode(model.generate(ids, do_sample=False, max_new_tokens=n))
    return transformers.__version__, "generate(do_sample=False)", *timed(run, spec["jobs"], spec["repeats"])


def onnxruntime_engine(spec: dict):
    import numpy as np
    import onnxruntime
    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = spec["threads"]
    session = onnxruntime.InferenceSession(spec["onnx"], options)
    pasts, chars, keep = session.get_inputs()[2:], spec["chars"], spec["block_size"] - 1

    def run(prompts: list[str], n: int) -> list[str]:
        # docs/export.md's loop: the cache fed back, kept to block_size - 1
        past = {p.name: np.zeros((len(prompts), p.shape[1], 0, p.shape[3]), np.float32) for p in pasts}
        ids = np.array([[chars.index(char) for char in prompt] for prompt in prompts])
        feed, position = ids, 0
        for _ in range(n):
            positions = np.arange(position, position + feed.shape[1])[None].repeat(len(prompts), 0)
            out = session.run(None, {"input_ids": feed, "position_ids": positions, **past})
            position += feed.shape[1]
            past = {p.name: present[:, :, -keep:] for p, present in zip(pasts, out[1:])}
            feed = out[0][:, -1].argmax(-1)[:, None]
            ids = np.concatenate([ids, feed], axis=1)
        return ["".join(chars[i] for i in row) for row in ids]
    return onnxruntime.__version__, "docs/export.md's loop", *timed(run, spec["jobs"], spec["repeats"])


def ctranslate2_engine(spec: dict):
    import ctranslate2
    from ctranslate2.converters import TransformersConverter
    out = Path(spec["hf"]).parent / "ct2"
    TransformersConverter(spec["hf"]).convert(str(out), force=True)
    generator = ctranslate2.Generator(str(out), intra_threads=spec["threads"])

    def run(prompts: list[str], n: int) -> list[str]:  # with its prompt, a result would drop a first character "bos"
        results = generator.generate_batch([list(prompt) for prompt in prompts], max_length=n, sampling_topk=1,
                                           end_token=[], include_prompt_in_result=False)
        return [prompt + "".join(result.sequences[0]) for prompt, result in zip(prompts, results)]
    setting = "end_token=[], include_prompt_in_result=False"
    return ctranslate2.__version__, setting, *timed(run, spec["jobs"], spec["repeats"])


def llama_cpp_engine(spec: dict, float32_cache: bool = False):
    import llama_cpp
    cache = {"type_k": llama_cpp.GGML_TYPE_F32, "type_v": llama_cpp.GGML_TYPE_F32} if float32_cache else {}
    longest = max(len(prompts[0]) + n for prompts, n in spec["jobs"])
    llm = llama_cpp.Llama(spec["gguf"], n_ctx=longest, n_threads=spec["threads"],
                          n_threads_batch=spec["threads"], verbose=False, **cache)

    def run(prompts: list[str], n: int) -> list[str]:
        if len(prompts) > 1:
            raise ValueError("llama-cpp-python's create_completion decodes one prompt at a time: batch 1 only")
        return [prompts[0] + llm.create_completion(prompts[0], max_tokens=n, temperature=0)["choices"][0]["text"]]
    setting = "create_completion(temperature=0)" + (", type_k and type_v f32" if float32_cache else "")
    return llama_cpp.__version__, setting, *timed(run, spec["jobs"], spec["repeats"])


def vllm_engine(spec: dict):
    """Each job's prompts in one generate call, as vLLM serves them."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB: the default takes a large share of memory
    import vllm
    llm = vllm.LLM(model=spec["hf"], dtype="float32")

    def run(prompts: list[str], n: int) -> list[str]:
        params = vllm.SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, skip_special_tokens=False)
        return [prompt + out.outputs[0].text for prompt, out in zip(prompts, llm.generate(prompts, params,
                                                                                            use_tqdm=False))]
    return vllm.__version__, "ignore_eos=True, skip_special_tokens=False", *timed(run, spec["jobs"], spec["repeats"])


def kvgpt_engine(spec: dict):
    """kvgpt's own generate through the packed compiled step (kept in spec's steps folder), timed as the others."""
    os.environ["KVGPT_CACHE_DIR"] = spec["steps"]
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import torch
    from model import GREEDY, generate
    from model.caches.factory import new_kv_cache
    from runtime.checkpoint import load_model
    from sampling.compiled_step import load_or_compile_step, prompt_tokens
    torch.set_num_threads(spec["threads"])
    model, vocab, _ = load_model(spec["checkpoint"], torch.device("cpu"), precision="fp32")
    cache = new_kv_cache(model, len(spec["jobs"][0][0]))
    # sample.py's step: the one-token pass decodes, the longer one takes the prompt
    step = load_or_compile_step(model, cache, prompt_tokens(model), packed=True,
                                say=lambda line: print(line, file=sys.stderr))

    def run(prompts: list[str], n: int) -> list[str]:
        ids = generate(model, torch.tensor([vocab.encode(prompt) for prompt in prompts]), n, sampling=GREEDY,
                       cache=cache, step=step)
        return [vocab.decode(row) for row in ids.tolist()]
    return torch.__version__, "generate(sampling=GREEDY, step=the packed step)", *timed(run, spec["jobs"],
                                                                                         spec["repeats"])


RUNNERS = {"transformers": transformers_engine, "onnxruntime": onnxruntime_engine,
           "ctranslate2": ctranslate2_engine, "llama.cpp": llama_cpp_engine,
           "llama.cpp-f32": lambda spec: llama_cpp_engine(spec, float32_cache=True), "vllm": vllm_engine,
           "kvgpt": kvgpt_engine}


def main() -> None:
    name, spec = sys.argv[1], json.loads(sys.argv[2])
    try:
        version, setting, texts, seconds = RUNNERS[name](spec)
        result = {"version": version, "setting": setting, "texts": texts, "seconds": seconds}
    except Exception as e:  # an engine that cannot load or run this design: its error is the finding
        result = {"error": f"{type(e).__name__}: {e}"}
    print("KVGPT " + json.dumps(result))


if __name__ == "__main__":  # vLLM starts its engine in processes of its own, which import this file again
    main()
