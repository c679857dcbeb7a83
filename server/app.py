"""The HTTP routes: OpenAI's completions and models, health, Prometheus metrics, the page with the pool and its
timeline.

Every /v1 route, the pool's picture and its timeline (they show prompts) take the API key as a bearer token when
one is set.
Every error is OpenAI's error JSON; no request names a file: the model is chosen when the server starts.
"""

import asyncio
import contextlib
import hmac
import json
import signal
import time
from pathlib import Path

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from data import CharVocab
from runtime.signals import StopSignals, hung_up
from .completions import Carried
from .metrics import CONTENT_TYPE
from .protocol import ApiError, Limits, parse_completion
from .runner import EngineRunner

STOP_SECONDS = 3  # how long a stopping server waits for its connections to close
MAX_BODY_BYTES = 1 << 20  # a request body past this is refused (413)
PAGE = Path(__file__).with_name("page.html")
PAGE_SCRIPT = Path(__file__).with_name("timeline.js")  # the page's timeline, a script of its own


def build_app(runner: EngineRunner, vocab: CharVocab, limits: Limits, api_key: str | None) -> FastAPI:
    app = FastAPI(title="kvgpt", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.stopping = asyncio.Event()  # set once the server stops: a body still arriving is refused then
    page, page_script = PAGE.read_text(encoding="utf-8"), PAGE_SCRIPT.read_text(encoding="utf-8")
    created = int(time.time())

    def authorize(request: Request) -> None:
        if api_key is None:
            return
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if not (scheme.lower() == "bearer" and hmac.compare_digest(given.encode(), api_key.encode())):
            raise ApiError(401, "a valid API key is needed: send it as 'Authorization: Bearer KEY'",
                           code="invalid_api_key")

    @app.exception_handler(ApiError)
    async def api_error(request: Request, e: ApiError):
        return error_response(e)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException):  # an unknown route or method
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return error_response(ApiError(e.status_code, f"{request.method} {request.url.path}: {e.detail}", kind=kind,
                                       headers=getattr(e, "headers", None)))

    @app.get("/", response_class=HTMLResponse)
    async def index():
        return HTMLResponse(page, headers={"Content-Security-Policy": "default-src 'self'; style-src 'unsafe-inline'; "
                                                                      "script-src 'self' 'unsafe-inline'"})

    @app.get("/timeline.js")
    async def timeline_script():
        return Response(page_script, media_type="text/javascript")

    @app.get("/health")
    async def health():
        if runner.failed or runner.stopping:
            return JSONResponse({"status": runner.failed or "stopping"}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(runner.metrics.render(runner.gauges), media_type=CONTENT_TYPE)

    served = {"id": limits.model, "object": "model", "created": created, "owned_by": "kvgpt",
              "max_model_len": limits.context, "vocabulary": vocab.chars}

    @app.get("/v1/models")
    async def models(request: Request):
        authorize(request)
        return {"object": "list", "data": [served]}

    @app.get("/v1/models/{model:path}")
    async def model(request: Request, model: str):
        authorize(request)
        if model != limits.model:
            raise ApiError(404, f"the model {model!r} does not exist: this server serves {limits.model!r}", "model",
                           "model_not_found")
        return served

    @app.get("/pool")
    async def pool(request: Request):
        authorize(request)
        return runner.snapshot

    @app.get("/timeline")
    async def timeline(request: Request):
        authorize(request)
        since = request.query_params.get("since", "0")
        if not (since.isascii() and since.isdigit()):
            raise ApiError(400, f"since must be a pass's number, 0 or more, got {since!r}", "since")
        return runner.timeline.since(int(since))

    @app.post("/v1/completions")
    async def completions(request: Request):
        authorize(request)
        body = await read_json(request, app.state.stopping)
        carried = Carried(parse_completion(body, vocab, limits), runner, limits.model)
        watcher = asyncio.create_task(watch_disconnect(request, carried))
        if carried.completion.stream:
            async def stream():
                try:
                    async for chunk in carried.stream():
                        yield chunk
                finally:
                    watcher.cancel()
            return StreamingResponse(stream(), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        try:
            return await carried.whole()
        finally:
            watcher.cancel()

    return app


async def read_json(request: Request, stopping: asyncio.Event):
    """The body as JSON, refused past MAX_BODY_BYTES before it is all read, and once the server stops (503): a
    client that sends half a body would otherwise hold the server's stop until its tasks are cancelled."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise too_large()
    reading, stopped = asyncio.ensure_future(read_body(request)), asyncio.ensure_future(stopping.wait())
    try:
        await asyncio.wait((reading, stopped), return_when=asyncio.FIRST_COMPLETED)
    finally:  # whichever is left, and both where this request itself is cancelled
        stopped.cancel()
        arrived = reading.done()
        reading.cancel()
    if not arrived:
        raise ApiError(503, "the server is stopping: it takes no more requests", kind="server_error")
    body = reading.result()
    try:
        return json.loads(body)
    except (ValueError, UnicodeDecodeError) as e:
        raise ApiError(400, f"the request body is not valid JSON: {e}") from None
    except RecursionError:
        raise ApiError(400, "the request body's JSON nests too deep to read") from None


async def read_body(request: Request) -> bytearray:
    body = bytearray()
    try:
        async for chunk in request.stream():
            body += chunk
            if len(body) > MAX_BODY_BYTES:
                raise too_large()
    except ClientDisconnect:  # no one is left to answer: the error goes nowhere, and nothing is logged
        raise ApiError(400, "the client closed the connection before its request body ended") from None
    return body


def error_response(e: ApiError) -> Response:
    """OpenAI's error JSON, in ASCII: a field's name from the request may hold characters UTF-8 cannot write."""
    return Response(json.dumps(e.body()), e.status, e.headers, media_type="application/json")


def too_large() -> ApiError:
    return ApiError(413, f"the request body is over {MAX_BODY_BYTES} bytes", code="request_too_large")


async def watch_disconnect(request: Request, carried: Carried) -> None:
    """Cancel the request's completions as soon as its client disconnects: their blocks go back to the pool."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    carried.gone()


class StoppingServer(uvicorn.Server):
    """uvicorn's server, which first ends every running stream and every request still arriving when told to
    stop, and then exits with status 0 (uvicorn would raise the signal again once it has stopped). It takes the
    stop signals (SIGINT, SIGTERM, SIGHUP) from take_signals() on, before it runs, not only while it runs."""

    def __init__(self, app: FastAPI, runner: EngineRunner):
        # no lifespan: the app has none, and its task, cancelled on a quick exit, would print a traceback
        super().__init__(uvicorn.Config(app, log_level="warning", lifespan="off",
                                        timeout_graceful_shutdown=STOP_SECONDS))
        self.app, self.runner = app, runner

    def take_signals(self) -> None:
        """From now on a stop signal stops the server: at once if it runs, as soon as it starts if not yet."""
        for sig in StopSignals.SIGNALS:
            signal.signal(sig, self.handle_exit)

    @contextlib.contextmanager
    def capture_signals(self):
        """take_signals() has set the handlers already, and they stay set after the server has stopped."""
        yield

    def handle_exit(self, sig, frame) -> None:
        """Every stop signal, a second one too, stops gracefully: what runs ends at once, with no task cancelled
        halfway (uvicorn's force exit would cancel them, each with a traceback)."""
        hung_up(sig)
        self.runner.stop("the server is stopping")
        self.should_exit = True

    async def shutdown(self, sockets=None) -> None:
        self.app.state.stopping.set()
        await super().shutdown(sockets)
