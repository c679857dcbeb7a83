"""What serve.py refuses, and how it stops: each bad request gets OpenAI's error JSON with its status and the server
goes on; the API key; a full queue; SIGTERM and Ctrl-C mid-stream; mistakes at start-up in one line."""

import http.client
import json
import select
import signal
import socket
import subprocess
import sys
import urllib.parse

import pytest
import torch

from corpus import REPO
from data import CharVocab
from model import build_model
from model.gpt import GPTConfig
from programs import assert_one_line_error
from runtime.checkpoint import build_checkpoint, save_checkpoint
from server.options import open_warning
from serving import ENV, START_SECONDS, VOCAB, Served, checkpoint, server  # noqa: F401  fixtures

pytestmark = pytest.mark.slow  # through the commands, end to end: python -m pytest -m slow

openai = pytest.importorskip("openai", reason="the tests drive serve.py with OpenAI's client: pip install openai")


def post(server, body, headers=None, path="/v1/completions", method="POST") -> tuple[int, object, dict]:
    """Status, headers and JSON of one request; body is sent as it is when it is bytes."""
    host = urllib.parse.urlsplit(server.url)
    connection = http.client.HTTPConnection(host.hostname, host.port, timeout=30)
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    connection.request(method, path, data, {"Content-Type": "application/json", **(headers or {})})
    response = connection.getresponse()
    status, answer = response.status, json.loads(response.read() or b"null")
    return status, response.headers, answer


LONG = "a" * 250
BAD = [  # body, status, the parameter named, a fragment of the message
    (b"{not json", 400, None, "not valid JSON"),
    (b"[1, 2]", 400, None, "must be a JSON object"),
    ({"max_tokens": 5}, 400, "prompt", "has no prompt"),
    ({"prompt": ""}, 400, "prompt", "the prompt is empty"),
    ({"prompt": ["ok", ""]}, 400, "prompt", "the prompt is empty"),
    ({"prompt": 42}, 400, "prompt", "a string or a non-empty list of strings"),
    ({"prompt": "ok", "max_tokens": "9"}, 400, "max_tokens", "must be an integer"),
    ({"prompt": "ok", "max_tokens": 0}, 400, "max_tokens", "at least 1, got 0"),
    ({"prompt": "ok", "max_tokens": -3}, 400, "max_tokens", "at least 1, got -3"),
    ({"prompt": LONG, "max_tokens": 7}, 400, "max_tokens", "context is 256 tokens (max_model_len), and the prompt "
                                                           "has 250: max_tokens can be at most 6"),
    ({"prompt": "a" * 256}, 400, "prompt", "has 256: a prompt can have at most 255"),
    ({"prompt": "ok", "temperature": -0.5}, 400, "temperature", "at least 0"),
    ({"prompt": "ok", "temperature": "hot"}, 400, "temperature", "must be a number"),
    ({"prompt": "ok", "top_p": 0}, 400, "top_p", "(0, 1]"),
    ({"prompt": "ok", "top_p": 1.5}, 400, "top_p", "(0, 1]"),
    ({"prompt": "ok", "temperature": 1e-39}, 400, "temperature", "a finite number >= 1.18e-38 (float32's smallest"),
    ({"prompt": "ok", "top_k": 2.5}, 400, "top_k", "integer"),
    ({"prompt": "ok", "temperature": 0, "top_k": 5}, 400, "top_k", "top_k and top_p apply to sampled text"),
    ({"prompt": "ok", "temperature": 0, "top_p": 0.5}, 400, "top_p", "top_k and top_p apply to sampled text"),
    ({"prompt": "ok", "stream": "yes"}, 400, "stream", "true or false"),
    ({"prompt": "ok", "stream": True, "stream_options": {"include_usage": "yes"}}, 400, "stream_options",
     "include_usage must be true or false"),
    ({"prompt": "ok", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop", "at most 4"),
    ({"prompt": "ok", "stop": ["ok", "x" * 256]}, 400, "stop", "of 256 characters can never end a text"),
    ({"prompt": "ok", "stop": "x" * 1_000_000}, 400, "stop", "of 1000000 characters can never end a text"),
    ({"prompt": "ok", "stop": ["ok", "café"]}, 400, "stop", "outside the model's vocabulary, so it can never end a "
                                                            "text: 'é'"),
    ({"prompt": "ok", "user": 5}, 400, "user", "user must be a string"),
    ({"prompt": "ok", "seed": -1}, 400, "seed", "seed must be an integer"),
    ({"prompt": "ok", "n": 0}, 400, "n", "at least 1"),
    ({"prompt": "ok", "logprobs": 21}, 400, "logprobs", "from 0 to 20"),
    ({"prompt": "ok", "logprobs": -1}, 400, "logprobs", "from 0 to 20"),
    ({"prompt": "ok", "logprobs": 2.5}, 400, "logprobs", "from 0 to 20"),
    ({"prompt": "ok", "logprobs": True}, 400, "logprobs", "from 0 to 20"),
    ({"prompt": "ok", "echo": "yes"}, 400, "echo", "echo must be true or false"),
    ({"prompt": "ok", "logprobs": 2, "max_tokens": 0}, 400, "max_tokens", "only with echo may it be 0"),
    ({"prompt": "ok", "echo": True, "max_tokens": -1}, 400, "max_tokens", "at least 0, got -1"),
    ({"prompt": "a" * 257, "echo": True, "max_tokens": 0}, 400, "prompt", "has 257: a prompt can have at most 256"),
    ({"prompt": "naïve café €"}, 400, "prompt", "outside the model's vocabulary: 'é', 'ï', '€'"),
    ({"prompt": "ok", "model": "../../etc/passwd"}, 404, "model", "does not exist"),
    ({"prompt": "ok", "checkpoint": "/etc/passwd"}, 400, "checkpoint", "unknown field 'checkpoint'"),
    (b'{"prompt": "' + b"a" * (1 << 20) + b'"}', 413, None, "over 1048576 bytes"),
    (b"[" * 100_000 + b"]" * 100_000, 400, None, "nests too deep"),
    (b'{"prompt": "ok", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", 400, None, "nests too deep"),
    (b'{"prompt": "ok", "\\ud800": 1}', 400, "\ud800", "unknown field '\\ud800'"),  # a lone surrogate as a name
]


@pytest.mark.parametrize("body, status, param, fragment", BAD, ids=[str(i) for i in range(len(BAD))])
def test_a_bad_request_gets_openai_error_json_with_its_status_and_the_server_goes_on(server, body, status, param,
                                                                                    fragment):
    got, _, answer = post(server, body)
    assert got == status, answer
    assert set(answer) == {"error"} and fragment in answer["error"]["message"], answer
    assert answer["error"]["param"] == param and answer["error"]["type"]
    ok, _, answer = post(server, {"prompt": "still", "max_tokens": 3, "temperature": 0})
    assert ok == 200 and len(answer["choices"][0]["text"]) == 3


def test_fields_at_the_values_that_change_nothing_are_taken(server):
    """OpenAI's defaults, null included, and a zero penalty written as a float, as OpenAI's own client writes it."""
    for field, value in (("frequency_penalty", 0.0), ("presence_penalty", 0.0), ("frequency_penalty", 0),
                         ("echo", None), ("echo", False), ("logprobs", None), ("stream", None), ("user", "me")):
        status, _, answer = post(server, {"prompt": "ok", "max_tokens": 3, "temperature": 0, field: value})
        assert status == 200 and len(answer["choices"][0]["text"]) == 3, (field, value, answer)


def test_unknown_routes_and_methods_get_error_json(server):
    assert post(server, None, path="/v2/nothing", method="GET")[0] == 404
    status, _, answer = post(server, None, path="/v1/completions", method="GET")
    assert status == 405 and "error" in answer


def test_the_openai_client_raises_its_own_errors_for_refusals(server):
    api = openai.OpenAI(base_url=server.api, api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError, match="at most 4"):
        api.completions.create(model=None, prompt="ok", stop=list("abcde"))
    with pytest.raises(openai.NotFoundError):
        api.completions.create(model="gpt-4", prompt="ok")


def test_a_full_queue_gets_429_with_retry_after_and_serves_again_once_it_empties(checkpoint):
    served = Served(checkpoint, "--max-batch", 1, "--max-waiting", 1)
    try:
        host = urllib.parse.urlsplit(served.url)
        busy = http.client.HTTPConnection(host.hostname, host.port, timeout=30)
        busy.request("POST", "/v1/completions", json.dumps({"prompt": "x", "max_tokens": 250, "n": 2,
                                                            "stream": True}), {"Content-Type": "application/json"})
        stream = busy.getresponse()
        assert stream.readline().startswith(b"data: {")  # one runs, one waits: the queue is full
        status, headers, answer = post(served, {"prompt": "ok", "max_tokens": 3})
        assert status == 429 and headers["Retry-After"] == "1" and answer["error"]["type"] == "rate_limit_error"
        status, _, answer = post(served, {"prompt": "ok", "n": 3})
        assert status == 400 and "at most 2 at once" in answer["error"]["message"]
        busy.close()
        for _ in range(100):  # the dropped stream leaves the engine; then a request runs
            status, _, answer = post(served, {"prompt": "ok", "max_tokens": 3})
            if status == 200:
                break
        assert status == 200
    finally:
        served.stop()


def test_an_api_key_is_asked_on_every_v1_route_the_pool_and_its_timeline(checkpoint):
    served = Served(checkpoint, env={**ENV, "KVGPT_API_KEY": "s3cret"})
    try:
        for path, method, body in (("/v1/models", "GET", None), ("/v1/completions", "POST", {"prompt": "ok"}),
                                   ("/pool", "GET", None), ("/timeline", "GET", None)):
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
                status, _, answer = post(served, body, headers, path, method)
                assert status == 401 and answer["error"]["code"] == "invalid_api_key", (path, headers)
            assert post(served, body, {"Authorization": "Bearer s3cret"}, path, method)[0] == 200, path
        assert post(served, None, path="/health", method="GET")[0] == 200  # for a load balancer's checks
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=served.api, api_key="wrong", max_retries=0).models.list()
        assert openai.OpenAI(base_url=served.api, api_key="s3cret", max_retries=0).models.list().data
    finally:
        served.stop()


@pytest.mark.parametrize("sig, name", [(signal.SIGTERM, "SIGTERM"), (signal.SIGINT, "Ctrl-C")])
def test_a_stop_signal_ends_running_streams_with_an_error_event_and_exits_0(checkpoint, sig, name):
    served = Served(checkpoint)
    assert served.url.startswith("http://127.0.0.1:")  # loopback, unless --host says otherwise
    host = urllib.parse.urlsplit(served.url)
    connection = http.client.HTTPConnection(host.hostname, host.port, timeout=30)
    connection.request("POST", "/v1/completions", json.dumps({"prompt": "x", "max_tokens": 250, "stream": True}),
                       {"Content-Type": "application/json"})
    stream = connection.getresponse()
    assert stream.readline().startswith(b"data: {")
    status, seconds, stderr = served.stop(sig)
    events = [line for line in stream.read().decode().splitlines() if line.startswith("data: ")]
    assert json.loads(events[-1][6:])["error"]["message"].endswith("the server is stopping"), events[-3:]
    assert status == 0 and seconds < 5 and "Traceback" not in stderr, (status, seconds, stderr)


def test_listening_beyond_loopback_without_a_key_is_warned_once_bound(checkpoint):
    """Tests listen on loopback only: here serve.py takes 127.0.0.1 for an address beyond it, and the addresses that
    are beyond it are checked without listening."""
    assert all(open_warning(host, None).startswith(f"warning: listening on {host} without an API key")
               for host in ("0.0.0.0", "::", "192.0.2.1", "example.com"))
    assert not any(open_warning(host, None) for host in ("127.0.0.1", "127.0.0.2", "::1", "localhost"))
    assert open_warning("0.0.0.0", "s3cret") is None
    beyond = ("import runpy, sys, server.options; server.options.is_loopback = lambda host: False; "
              "sys.argv[0] = 'serve.py'; runpy.run_path('serve.py', run_name='__main__')")
    process = subprocess.Popen([sys.executable, "-c", beyond, "--checkpoint", str(checkpoint), "--port", "0",
                                "--no-compile"],
                               cwd=REPO, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        ready, _, _ = select.select([process.stdout], [], [], START_SECONDS)
        lines = [process.stdout.readline(), process.stdout.readline()] if ready else []
    finally:
        process.kill()
        process.wait()
    assert lines[0].startswith("serving ") and "http://127.0.0.1:" in lines[0], lines
    assert lines[1].startswith("warning: listening on 127.0.0.1 without an API key"), lines
    # 192.0.2.1, for documentation, is on no machine: it cannot be bound, and the error comes alone
    result = subprocess.run([sys.executable, str(REPO / "serve.py"), "--checkpoint", str(checkpoint), "--host",
                             "192.0.2.1", "--port", "0", "--no-compile"], env=ENV, capture_output=True, text=True, timeout=120)
    assert_one_line_error(result, "serve.py", "cannot listen on 192.0.2.1:0")


@pytest.fixture(scope="module")
def local_window_checkpoint(tmp_path_factory):
    model = build_model(GPTConfig(vocab_size=len(VOCAB), block_size=32, n_layer=2, n_head=2, n_embd=16,
                                  window_pattern="LG", local_window=8))
    return save_checkpoint(build_checkpoint(model, VOCAB), tmp_path_factory.mktemp("local") / "best.pt")


def test_mistakes_at_start_are_one_line_with_status_2(checkpoint, local_window_checkpoint):
    def serve(*args, env=ENV, code=None):
        command = [sys.executable, "-c", code, *map(str, args)] if code else \
            [sys.executable, str(REPO / "serve.py"), "--no-compile", *map(str, args)]
        return subprocess.run(command, env=env, capture_output=True, text=True, timeout=120, cwd=REPO)

    assert_one_line_error(serve("--checkpoint", local_window_checkpoint), "serve.py", "local layers",
                          "sample.py decodes it")
    assert_one_line_error(serve("--checkpoint", checkpoint, "--blocks", 3), "serve.py",
                          "--blocks 3 cannot hold one full context")
    assert_one_line_error(serve("--checkpoint", checkpoint, "--max-batch", 0), "serve.py", "--max-batch must be >= 1")
    assert_one_line_error(serve("--checkpoint", checkpoint, "--max-batch", 10**8), "serve.py",
                          "GiB of cpu memory; lower --max-batch")  # refused before it is allocated
    assert_one_line_error(serve("--checkpoint", checkpoint, "--blocks", 10**400), "serve.py",
                          "GiB of cpu memory; lower --max-batch or --blocks")  # too many bytes for a float
    assert_one_line_error(serve("--checkpoint", checkpoint, "--api-key", " "), "serve.py", "--api-key is empty")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert_one_line_error(serve("--checkpoint", checkpoint, "--port", port), "serve.py",
                              f"cannot listen on 127.0.0.1:{port}", "give another --port")
    without_fastapi = ("import runpy, sys; sys.modules['fastapi'] = None; sys.argv[0] = 'serve.py'; "
                       "runpy.run_path('serve.py', run_name='__main__')")
    assert_one_line_error(serve("--checkpoint", checkpoint, code=without_fastapi), "serve.py",
                          "needs fastapi and uvicorn", "pip install -r requirements-serve.txt")


def test_a_fault_in_the_engines_thread_ends_every_request_with_503_and_health_says_so(tmp_path):
    """A checkpoint whose head is wider than its vocabulary draws ids with no character: the engine's thread fails
    on the first, and no client waits for ever."""
    torch.manual_seed(0)
    model = build_model(GPTConfig(vocab_size=64, block_size=32, n_layer=1, n_head=1, n_embd=8))
    served = Served(save_checkpoint(build_checkpoint(model, CharVocab("ab")), tmp_path / "best.pt"))
    try:
        status, _, answer = post(served, {"prompt": "ab", "max_tokens": 20, "temperature": 1.0, "seed": 0})
        assert status == 503 and "the engine failed" in answer["error"]["message"], answer
        status, _, answer = post(served, None, path="/health", method="GET")
        assert status == 503 and answer["status"].startswith("the engine failed"), answer
    finally:
        served.stop()
