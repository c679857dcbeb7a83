"""How serve.py stops, and what it says: a client that goes halfway and a stop with requests half sent leave stderr
empty; a stop signal at the moment the URL is printed stops it with status 0."""

import json
import signal
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request

import pytest

from corpus import REPO
from programs import child_signal
from serving import ENV, START_SECONDS, checkpoint  # noqa: F401  fixtures
from serving import Served

BODY = json.dumps({"prompt": "hello", "max_tokens": 4}).encode()


def half_sent(served: Served, framing: str) -> socket.socket:
    """A connection that has sent a completion's headers and the first half of its body, and waits."""
    host = urllib.parse.urlsplit(served.url)
    connection = socket.create_connection((host.hostname, host.port), timeout=30)
    length = f"Content-Length: {len(BODY)}" if framing == "content-length" else "Transfer-Encoding: chunked"
    half = BODY[:len(BODY) // 2]
    sent = half if framing == "content-length" else b"%x\r\n%s\r\n" % (len(half), half)
    connection.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{length}\r\n"
                       f"\r\n".encode() + sent)
    return connection


def healthy(served: Served) -> bool:
    with urllib.request.urlopen(served.url + "/health", timeout=30) as answer:
        return json.load(answer) == {"status": "ok"}


def test_clients_that_close_before_their_body_ends_leave_stderr_empty(checkpoint):
    served = Served(checkpoint)
    try:
        for framing in ("content-length", "chunked", "content-length", "chunked"):
            half_sent(served, framing).close()
        time.sleep(0.3)  # the server has seen them go
        assert healthy(served)
    finally:
        status, _, stderr = served.stop()
    assert status == 0 and stderr == "", stderr


@pytest.mark.parametrize("signals", [(signal.SIGTERM,), (signal.SIGTERM, signal.SIGINT)],
                         ids=["SIGTERM", "SIGTERM then Ctrl-C"])
def test_a_stop_answers_requests_still_arriving_and_leaves_stderr_empty(checkpoint, signals):
    """Each client half sent gets a 503 saying why, before the server exits; a second signal changes nothing."""
    served = Served(checkpoint)
    clients = [half_sent(served, framing) for framing in ("content-length", "chunked")]
    time.sleep(0.3)  # their requests have begun
    for sig in signals[:-1]:
        served.process.send_signal(sig)
        time.sleep(0.05)
    status, _, stderr = served.stop(signals[-1])
    answers = [client.makefile("rb").read().decode() for client in clients]
    assert status == 0 and stderr == "", stderr
    for answer in answers:
        assert answer.startswith("HTTP/1.1 503 ") and "the server is stopping" in answer, answer


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP], ids=lambda s: s.name)
def test_a_stop_signal_as_the_url_appears_exits_0(checkpoint, sig):
    """Whoever reads the URL may stop the server at once: the signal is handled by then."""
    process = subprocess.Popen([sys.executable, str(REPO / "serve.py"), "--checkpoint", str(checkpoint), "--port", "0",
                                "--no-compile"],
                               env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               preexec_fn=child_signal(sig))
    try:
        line = process.stdout.readline()
        process.send_signal(sig)
        _, stderr = process.communicate(timeout=START_SECONDS)
    finally:
        process.kill()
    assert "http://" in line and process.returncode == 0 and stderr == "", (line, process.returncode, stderr)
