"""End-to-end tests of sample.py: the real command in a subprocess, on a tiny checkpoint trained here."""

import builtins
import os
import pty
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from data import CharVocab
from model import GPT, GPTConfig, build_model
import runtime.devices
from runtime.checkpoint import FORMAT, VERSION, build_checkpoint, save_checkpoint
from corpus import CITIZENS
from tiny_models import train_briefly

REPO = Path(__file__).resolve().parents[1]
SAMPLE = REPO / "sample.py"
SEPARATOR = "---------------\n"

TEXT = CITIZENS
VOCAB = CharVocab.from_text(TEXT)
BLOCK_SIZE = 16
NEW_TOKENS = 3 * BLOCK_SIZE + 5  # well past 2 * block_size, so the context is cut back more than once
PROMPT = "First Citizen:\n"
LONG_PROMPT = "All:\nSpeak, speak.\n\nFirst Citizen:\nYou are all"  # longer than BLOCK_SIZE
# One thread per process: the model is tiny, and several torch processes on a few shared cores slow
# each other down many times over when each spins up a thread per core.
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def tiny_model(seed: int, train_steps: int, pos_emb: str = "learned") -> GPT:
    torch.manual_seed(seed)
    model = build_model(GPTConfig(vocab_size=len(VOCAB), block_size=BLOCK_SIZE, n_layer=2, n_head=2, n_embd=32,
                          pos_emb=pos_emb))
    # A little training makes the output depend on the context, so that a broken cache changes it.
    train_briefly(model, torch.tensor(VOCAB.encode(TEXT)), steps=train_steps, batch_size=16)
    return model.eval()


def checkpoint_state(model: GPT) -> dict:
    return build_checkpoint(model, VOCAB)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    model = tiny_model(seed=0, train_steps=120)
    return save_checkpoint(checkpoint_state(model), tmp_path_factory.mktemp("run") / "best.pt")


def run_sample(*args, cwd=REPO) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SAMPLE), *map(str, args)], cwd=cwd, env=ENV,
                          capture_output=True, text=True, timeout=300)


def sample_ok(*args, cwd=REPO) -> subprocess.CompletedProcess:
    result = run_sample(*args, cwd=cwd)
    assert result.returncode == 0, result.stderr
    return result


@pytest.fixture(scope="module")
def greedy(checkpoint) -> subprocess.CompletedProcess:
    return sample_ok("--checkpoint", checkpoint, "--prompt", PROMPT, "--temperature", 0,
                     "--max-new-tokens", NEW_TOKENS)


def test_greedy_output_and_summary(checkpoint, greedy):
    assert greedy.stdout.startswith(PROMPT) and greedy.stdout.endswith("\n")
    generated = greedy.stdout[len(PROMPT):-1]
    assert len(generated) == NEW_TOKENS
    assert len(set(generated)) >= 5, f"degenerate output {generated!r} would hide a broken cache"
    info, summary = greedy.stderr.splitlines()
    assert info == f"sampling {checkpoint} (weights only), trained on an unrecorded text"
    assert re.fullmatch(rf"{NEW_TOKENS} tokens in [\d.]+ s, [\d.]+ tokens/s at fp32, KV cache [\d.]+ MiB in float32 "
                        rf"\(cpu, 1 thread\)", summary)  # the suite's environment names 1 (OMP_NUM_THREADS)


def test_greedy_without_cache_is_identical(checkpoint, greedy):
    result = sample_ok("--checkpoint", checkpoint, "--prompt", PROMPT, "--temperature", 0,
                       "--max-new-tokens", NEW_TOKENS, "--no-kv-cache")
    assert result.stdout == greedy.stdout
    assert result.stderr.splitlines()[-1].endswith(" tokens/s at fp32, no cache (cpu, 1 thread)")


def test_the_threads_are_timed_or_named_and_leave_the_text_as_it_is(checkpoint, greedy):
    """Without OMP_NUM_THREADS or --threads, sample.py decodes with the count it timed fastest."""
    common = ("--checkpoint", checkpoint, "--prompt", PROMPT, "--temperature", 0, "--max-new-tokens", NEW_TOKENS)
    unnamed = {key: value for key, value in ENV.items() if key != "OMP_NUM_THREADS"}
    timed = subprocess.run([sys.executable, str(SAMPLE), *map(str, common)], cwd=REPO, env=unnamed,
                           capture_output=True, text=True, timeout=300)
    assert timed.returncode == 0 and timed.stdout == greedy.stdout, timed.stderr
    assert 1 <= int(re.search(r"\(cpu, (\d+) threads?\)$", timed.stderr)[1]) <= os.cpu_count()
    named = subprocess.run([sys.executable, str(SAMPLE), *map(str, common), "--threads", "2"], cwd=REPO, env=unnamed,
                           capture_output=True, text=True, timeout=300)
    assert named.stdout == greedy.stdout and named.stderr.endswith("(cpu, 2 threads)\n")
    refused = run_sample(*common, "--threads", 0)
    assert (refused.returncode, refused.stderr) == (2, "sample.py: error: --threads must be >= 1, got 0\n")


def test_fastest_threads_keeps_the_count_whose_work_took_least_timed_in_turns(monkeypatch):
    """Each count's work runs in turns, an untimed turn first; the median of the timed turns decides."""
    monkeypatch.setattr(runtime.devices, "DEFAULT_THREADS", 4)
    now, ran = [0.0], []
    monkeypatch.setattr(runtime.devices, "clock", lambda: now[0])
    try:
        for cost, fastest in (({1: [3, 3, 9, 3], 2: [2, 2, 2, 9], 4: [9, 1, 1, 9]}, 4),
                              ({1: [1, 9, 1, 1], 2: [5, 5, 5, 5], 4: [9, 9, 9, 1]}, 1)):
            ran.clear()

            def work():
                threads = torch.get_num_threads()
                now[0] += cost[threads][sum(1 for n in ran if n == threads)]
                ran.append(threads)

            threads, seconds = runtime.devices.fastest_threads(work, rounds=3)
            assert ran == [1, 2, 4] * 4  # in turns
            medians = {n: sorted(costs[1:])[1] for n, costs in cost.items()}  # the untimed turn left out
            assert (threads, torch.get_num_threads(), seconds) == (fastest, fastest, medians)
    finally:
        torch.set_num_threads(1)  # the suite's count


def test_racing_threads_stops_a_count_once_it_has_lost_its_turn(monkeypatch):
    """Counts take turns, fewest threads first; a count stops at the first step that takes it past the fastest
    count of its turn, and the lowest median wins. A count 10x slower runs 2 of its 16 steps, not 16."""
    monkeypatch.setattr(runtime.devices, "DEFAULT_THREADS", 2)
    now, ran = [0.0], []
    monkeypatch.setattr(runtime.devices, "clock", lambda: now[0])
    try:
        for cost, fastest, steps_run in (({1: 1.0, 2: 10.0}, 1, {1: 16, 2: 2}), ({1: 1.0, 2: 0.5}, 2, {1: 16, 2: 16})):
            ran.clear()

            def steps():
                for _ in range(16):
                    now[0] += cost[torch.get_num_threads()]
                    ran.append(torch.get_num_threads())
                    yield

            threads, seconds = runtime.devices.race_threads(steps, rounds=3)
            assert (threads, torch.get_num_threads()) == (fastest, fastest)
            assert {n: ran.count(n) for n in (1, 2)} == {n: 4 * steps_run[n] for n in (1, 2)}  # 4 turns each
            assert seconds == {n: steps_run[n] * cost[n] for n in (1, 2)}
    finally:
        torch.set_num_threads(1)  # the suite's count


def test_classic_window_and_long_prompt_identical_without_cache(checkpoint, greedy):
    common = ("--checkpoint", checkpoint, "--prompt", LONG_PROMPT, "--temperature", 0,
              "--max-new-tokens", NEW_TOKENS, "--window", BLOCK_SIZE)
    cached, uncached = sample_ok(*common).stdout, sample_ok(*common, "--no-kv-cache").stdout
    assert cached.startswith(LONG_PROMPT) and len(cached) == len(LONG_PROMPT) + NEW_TOKENS + 1
    assert cached == uncached


def test_seeded_sampling_is_reproducible_with_and_without_cache(checkpoint):
    common = ("--checkpoint", checkpoint, "--prompt", PROMPT, "--max-new-tokens", NEW_TOKENS,
              "--temperature", 1.0, "--top-k", 10, "--top-p", 0.95)
    first = sample_ok(*common, "--seed", 7).stdout
    assert sample_ok(*common, "--seed", 7).stdout == first
    assert sample_ok(*common, "--seed", 7, "--no-kv-cache").stdout == first
    assert sample_ok(*common, "--seed", 8).stdout != first


@pytest.mark.parametrize("narrowing", [["--top-k", 1], ["--top-p", 1e-6], ["--top-p", 1e-46]])  # 0 in float32
def test_top_k_1_and_a_tiny_top_p_sample_greedily(checkpoint, greedy, narrowing):
    result = sample_ok("--checkpoint", checkpoint, "--prompt", PROMPT, "--max-new-tokens", NEW_TOKENS,
                       "--temperature", 1.0, *narrowing)
    assert result.stdout == greedy.stdout


def test_unseeded_sampling_differs_between_runs(checkpoint):
    common = ("--checkpoint", checkpoint, "--prompt", PROMPT, "--max-new-tokens", NEW_TOKENS, "--temperature", 1.0)
    assert sample_ok(*common).stdout != sample_ok(*common).stdout


def test_num_samples_gives_separate_samples(checkpoint):
    result = sample_ok("--checkpoint", checkpoint, "--prompt", PROMPT, "--max-new-tokens", NEW_TOKENS,
                       "--temperature", 1.0, "--num-samples", 3, "--seed", 1)
    samples = result.stdout.split(SEPARATOR)
    assert len(samples) == 3
    for sample in samples:
        assert sample.startswith(PROMPT) and len(sample) == len(PROMPT) + NEW_TOKENS + 1
    assert len(set(samples)) == 3
    assert result.stderr.splitlines()[1].startswith(f"{3 * NEW_TOKENS} tokens in ")


def test_zero_new_tokens_prints_the_prompt_alone(checkpoint):
    result = sample_ok("--checkpoint", checkpoint, "--prompt", PROMPT, "--max-new-tokens", 0)
    assert result.stdout == PROMPT + "\n"


def test_terminal_output_streams_the_same_text(checkpoint, greedy):
    # A pseudo-terminal as stdout takes the streaming path; its line discipline turns "\n" into "\r\n".
    controller, terminal = pty.openpty()
    process = subprocess.Popen([sys.executable, str(SAMPLE), "--checkpoint", str(checkpoint), "--prompt", PROMPT,
                                "--temperature", "0", "--max-new-tokens", str(NEW_TOKENS)],
                               cwd=REPO, env=ENV, stdout=terminal, stderr=subprocess.PIPE)
    os.close(terminal)
    output = b""
    while True:
        try:
            chunk = os.read(controller, 4096)
        except OSError:  # EIO once the process has closed the terminal
            break
        if not chunk:
            break
        output += chunk
    os.close(controller)
    assert process.wait(timeout=300) == 0, process.stderr.read()
    assert output.decode().replace("\r\n", "\n") == greedy.stdout


def test_newest_run_is_found_under_runs(checkpoint, greedy, tmp_path):
    # The older run is copied last and sorts last by name: only the write time may decide.
    newer = tmp_path / "runs/2024-06-01/10-00-00/best.pt"
    newer.parent.mkdir(parents=True)
    newer.write_bytes(checkpoint.read_bytes())
    older = tmp_path / "runs/multirun/2024-06-02/10-00-00/0/best.pt"
    older.parent.mkdir(parents=True)
    save_checkpoint(checkpoint_state(tiny_model(seed=1, train_steps=0)), older)
    os.utime(older, ns=(1_700_000_000 * 10**9,) * 2)
    os.utime(newer, ns=(1_700_000_100 * 10**9,) * 2)
    result = sample_ok("--prompt", PROMPT, "--temperature", 0, "--max-new-tokens", NEW_TOKENS, cwd=tmp_path)
    assert result.stdout == greedy.stdout
    assert "runs/2024-06-01/10-00-00/best.pt" in result.stderr


# --- bad input: one line on stderr, exit status 2, no traceback ---------------------------------------------------

def assert_usage_error(result: subprocess.CompletedProcess, *fragments: str) -> str:
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("sample.py: error: "), result.stderr
    for fragment in fragments:
        assert fragment in lines[0]
    assert result.stdout == ""
    return lines[0]


def unavailable_device() -> str:
    if not torch.cuda.is_available():
        return "cuda"
    if not torch.backends.mps.is_available():
        return "mps"
    pytest.skip("every device is available here")


@pytest.mark.parametrize("args, fragments", [
    (["--temperature", -0.5], ["temperature must be", "-0.5"]),
    (["--top-k", 0], ["top_k must be", ">= 1"]),
    (["--top-p", 1.5], ["top_p must be", "1.5"]),
    (["--max-new-tokens", -1], ["max_new_tokens must be", "-1"]),
    (["--num-samples", 0], ["--num-samples", "0"]),
    (["--keep", BLOCK_SIZE + 1], ["keep must be an integer in", f"[1, block_size={BLOCK_SIZE}]"]),
    (["--top-k", "many"], ["--top-k", "'many'"]),
    (["--prompt", ""], ["--prompt", "empty"]),
    (["--compile", "--no-kv-cache"], ["--compile", "--no-kv-cache"]),
    (["--kv-cache", "int3"], ["--kv-cache", "'int3'"]),
    (["--kv-cache", "int4", "--compile"], ["--kv-cache int4 decodes eagerly", "drop --compile"]),
    (["--compile", "--device", "mps"], ["--compile builds steps for cpu or cuda, not --device mps"]),
    (["--kv-budget", 8], ["--kv-budget applies to --kv-cache window, sinks, h2o, tova, merge"]),
    (["--kv-cache", "h2o"], ["--kv-cache h2o: ", "needs pos_emb=rope"]),
])
def test_bad_option_values(checkpoint, args, fragments):
    assert_usage_error(run_sample("--checkpoint", checkpoint, *args), *fragments)


def test_unavailable_device(checkpoint):
    device = unavailable_device()
    result = run_sample("--checkpoint", checkpoint, "--device", device)
    assert_usage_error(result, f"--device {device}", "not available")


def test_unknown_prompt_characters_are_named_with_the_vocabulary(checkpoint):
    line = assert_usage_error(run_sample("--checkpoint", checkpoint, "--prompt", "Fïrst €itizen"), "'ï'", "'€'")
    assert repr(VOCAB.chars) in line


@pytest.mark.parametrize("content, fragments", [
    (b"", ["empty"]),
    (None, ["cannot read", "No such file"]),
    (b"\xff\xfe bad", ["not UTF-8"]),
])
def test_bad_prompt_file(checkpoint, tmp_path, content, fragments):
    path = tmp_path / "prompt.txt"
    if content is not None:
        path.write_bytes(content)
    assert_usage_error(run_sample("--checkpoint", checkpoint, "--prompt-file", path), str(path), *fragments)


def test_prompt_file_is_used(checkpoint, greedy, tmp_path):
    path = tmp_path / "prompt.txt"
    path.write_text(PROMPT)
    result = sample_ok("--checkpoint", checkpoint, "--prompt-file", path, "--temperature", 0,
                       "--max-new-tokens", NEW_TOKENS)
    assert result.stdout == greedy.stdout


def test_no_checkpoint_found(tmp_path):
    line = assert_usage_error(run_sample(cwd=tmp_path), "python train.py")
    assert str(tmp_path.resolve() / "runs") in line
    assert_usage_error(run_sample("--checkpoint", tmp_path / "missing.pt"), str(tmp_path / "missing.pt"))


@pytest.mark.parametrize("make_bad_file, fragments", [
    (lambda good, path: path.write_bytes(good.read_bytes()[: good.stat().st_size // 2]), ["truncated"]),
    (lambda good, path: path.write_bytes(b"these are not the weights you are looking for"), ["corrupt"]),
    (lambda good, path: torch.save({"weights": torch.zeros(3)}, path), ["not a kvgpt checkpoint"]),
    (lambda good, path: save_checkpoint({"format": FORMAT, "version": VERSION, "model_config": {"n_wings": 2},
                                                  "vocab": "ab", "model": {}}, path),
     ["does not fit this version of the model"]),
])
def test_bad_checkpoint(checkpoint, tmp_path, make_bad_file, fragments):
    path = tmp_path / "bad.pt"
    make_bad_file(checkpoint, path)
    assert_usage_error(run_sample("--checkpoint", path), str(path), *fragments)


class OpensMarkerFile:
    """Unpickling this object runs open(marker, "w"): a stand-in for any code a malicious pickle would run."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return builtins.open, (str(self.marker), "w")


def test_checkpoint_that_would_run_code_is_refused_as_unsafe(tmp_path):
    marker, path = tmp_path / "code-ran", tmp_path / "evil.pt"
    torch.save({"format": FORMAT, "model_config": {}, "vocab": "ab", "model": OpensMarkerFile(marker)}, path)
    assert_usage_error(run_sample("--checkpoint", path), str(path), "unsafe", "io.open")  # names the callable
    assert not marker.exists()
    torch.load(path, weights_only=False)  # the test's own check that loading it unsafely does run the code
    assert marker.exists()


def events_file(path: Path) -> None:
    from torch.utils.tensorboard import SummaryWriter

    with SummaryWriter(str(path.parent)) as writer:
        writer.add_scalar("loss", 1.0, 0)
    next(path.parent.glob("events.out.tfevents.*")).rename(path)


@pytest.mark.parametrize("make_file", [lambda path: path.write_text("JULIET:\nO Romeo, Romeo!\n"), events_file],
                         ids=["text", "events"])
def test_a_file_that_is_no_pickle_is_not_called_unsafe(tmp_path, make_file):
    path = tmp_path / "not-a-checkpoint" / "file.pt"
    path.parent.mkdir()
    make_file(path)
    line = assert_usage_error(run_sample("--checkpoint", path), str(path), "corrupt or not a PyTorch checkpoint")
    assert "unsafe" not in line and "run code" not in line


@pytest.mark.slow
def test_the_compiled_step_gives_the_same_text_and_is_kept(checkpoint, greedy, tmp_path):
    """--compile compiles the step once and says so; later runs take the kept step by default, and --no-compile
    decodes eagerly. The text is the eager text each time (sampling/compiled_step.py)."""
    env = {**ENV, "KVGPT_CACHE_DIR": str(tmp_path)}
    args = [sys.executable, str(SAMPLE), "--checkpoint", str(checkpoint), "--prompt", PROMPT, "--temperature", "0",
            "--max-new-tokens", str(NEW_TOKENS)]
    runs = {flag: subprocess.run(args + ([flag] if flag else []), cwd=REPO, env=env, capture_output=True, text=True,
                                 timeout=300) for flag in ("--compile", None, "--no-compile")}
    for flag, result in runs.items():
        assert result.returncode == 0, result.stderr
        assert result.stdout == greedy.stdout, flag
        summary = result.stderr.splitlines()[-1]
        assert summary.endswith("(cpu, 1 thread, compiled step)" if flag != "--no-compile" else "(cpu, 1 thread)")
    assert runs["--compile"].stderr.splitlines()[1].startswith(
        f"compiling the decoding step, with a pass of up to {BLOCK_SIZE} tokens for prompts, for these weights, once")
    assert "compiling" not in runs[None].stderr and len(runs[None].stderr.splitlines()) == 2


@pytest.mark.parametrize("bits", [4, 2])
def test_a_low_bit_cache_decodes_and_the_summary_names_it(checkpoint, bits):
    """Its most recent tokens are exact (model/caches/lowbit.py), so the first 32 characters are the float
    cache's; the summary names the cache and its size."""
    common = ["--checkpoint", checkpoint, "--prompt", PROMPT, "--temperature", 0, "--max-new-tokens", NEW_TOKENS]
    plain = sample_ok(*common).stdout
    result = sample_ok(*common, "--kv-cache", f"int{bits}", "--num-samples", 2)
    assert result.stdout.startswith(PROMPT)
    first = result.stdout.split(SEPARATOR)[0]
    assert first[:len(PROMPT) + BLOCK_SIZE] == plain[:len(PROMPT) + BLOCK_SIZE]
    assert re.search(rf"KV cache [\d.]+ MiB in int{bits} ", result.stderr.splitlines()[-1])


@pytest.fixture(scope="module")
def rope_checkpoint(tmp_path_factory) -> Path:
    model = tiny_model(seed=0, train_steps=120, pos_emb="rope")
    return save_checkpoint(checkpoint_state(model), tmp_path_factory.mktemp("rope") / "best.pt")


def test_a_window_of_block_size_is_the_full_cache_and_sinks_decode_past_it(rope_checkpoint):
    """A window of block_size slots keeps all a rotary model sees: the greedy text is the float cache's. Sinks with
    half the budget decode the same number of characters, several samples at once, and the summary names them."""
    common = ["--checkpoint", rope_checkpoint, "--prompt", PROMPT, "--temperature", 0, "--max-new-tokens", NEW_TOKENS]
    plain = sample_ok(*common).stdout
    assert sample_ok(*common, "--kv-cache", "window", "--kv-budget", BLOCK_SIZE).stdout == plain
    sinks = sample_ok(*common, "--kv-cache", "sinks", "--kv-budget", BLOCK_SIZE // 2, "--num-samples", 2)
    first, second = sinks.stdout.split(SEPARATOR)[:2]
    assert first == second and len(first) == len(plain)
    assert re.search(r"KV cache [\d.]+ MiB in sinks ", sinks.stderr.splitlines()[-1])


@pytest.mark.parametrize("policy", ["h2o", "merge"])  # test_evicting_cache.py and test_merging_cache.py prove them
def test_an_eviction_policy_decodes_past_its_budget_and_the_summary_names_it(rope_checkpoint, policy):
    """Until the prompt and the first new token fill the budget (block_size), the text is the float cache's; past
    it, the samples of one prompt still agree, and the summary names the policy."""
    common = ["--checkpoint", rope_checkpoint, "--prompt", PROMPT, "--temperature", 0, "--max-new-tokens", NEW_TOKENS]
    plain = sample_ok(*common).stdout
    result = sample_ok(*common, "--kv-cache", policy, "--kv-budget", BLOCK_SIZE, "--num-samples", 2)
    first, second = result.stdout.split(SEPARATOR)[:2]
    assert first == second and len(first) == len(plain)
    assert first[:len(PROMPT) + 2] == plain[:len(PROMPT) + 2]
    assert re.search(rf"KV cache [\d.]+ MiB in {policy} ", result.stderr.splitlines()[-1])


@pytest.mark.parametrize("args, fragments", [
    (["--kv-cache", "sinks", "--kv-budget", 4], ["--kv-cache sinks: ", "a budget of 4 slots leaves none for the "
                                                 "last tokens beside 4 sinks: give at least 5"]),
    (["--kv-cache", "tova", "--kv-budget", 1], ["--kv-cache tova: ", "budget must be an integer from 2 to "
                                                "block_size=16, got 1"]),
    (["--kv-cache", "h2o", "--compile"], ["--kv-cache h2o decodes eagerly"]),
    (["--kv-cache", "window", "--kv-budget", BLOCK_SIZE + 1], ["budget must be an integer from 1 to block_size=16, got 17"]),
    (["--kv-cache", "sinks", "--compile"], ["--kv-cache sinks decodes eagerly"]),
    (["--kv-cache", "window", "--read-all-slots"], ["--read-all-slots applies to the ring"]),
])
def test_a_budget_that_cannot_work_is_refused(rope_checkpoint, args, fragments):
    assert_usage_error(run_sample("--checkpoint", rope_checkpoint, *args), *fragments)
