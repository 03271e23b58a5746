"""`vllm serve`: the OpenAI-compatible HTTP server (FastAPI + uvicorn) in the API-server process.

The engine core and the workers run in their own processes (see `engine/core_client.py`).

Lifecycle: the listening socket is bound before the engine starts (a busy port fails at once;
``--port 0`` takes a port the OS picks, logged in the "listening on" line); connections wait
in the backlog until the engine is ready. SIGTERM or SIGINT fail the open requests, stop the
engine (killing its processes if a step does not end within seconds) and exit 0. If the engine
dies or freezes (heartbeats), open requests fail, /health turns 503 and the server exits non-zero
with the cause.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import errno
import json
import os
import signal
import socket
import sys
import threading
import time
from contextlib import asynccontextmanager

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

from vllm.engine.arg_utils import EngineArgs
from vllm.engine.async_llm import AsyncLLM
from vllm.entrypoints.openai.chat_utils import ChatParsers, add_chat_parser_args
from vllm.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest, error_body
from vllm.entrypoints.openai.serving import OpenAIServing, new_request_id
from vllm.metrics import Metrics
from vllm.utils import EngineDeadError, freeze_gc_heap, init_logging, logger


class ServerState:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.engine: AsyncLLM | None = None
        self.serving: OpenAIServing | None = None
        self.metrics: Metrics | None = None
        self.server: uvicorn.Server | None = None
        self.dead: str | None = None
        self.stopping = False  # SIGTERM / SIGINT: engine processes going away are no death
        self.exit_code = 0


# control endpoints: behind --api-key like /v1
ADMIN_PATHS = frozenset({"/reset_prefix_cache"})
# request bodies larger than this are refused (413) before they are read or parsed
MAX_BODY_BYTES = 32 << 20


class BodyTooLarge(Exception):
    pass


class ClientDisconnected(Exception):
    pass


class RequestGuard:
    """The API key on /v1 and the admin endpoints, and the body-size limit by Content-Length,
    checked before a request reaches its handler. A plain ASGI middleware: Starlette's
    ``BaseHTTPMiddleware`` would hide client disconnects from the handlers."""

    def __init__(self, app, api_key: str | None):
        self.app, self.auth = app, f"Bearer {api_key}".encode() if api_key else None

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            headers = dict(scope["headers"])
            path = scope["path"]
            refused = None
            if self.auth and (path.startswith("/v1") or path in ADMIN_PATHS):
                if headers.get(b"authorization") != self.auth:
                    refused = _err(
                        "Unauthorized: missing or wrong API key", 401, "AuthenticationError"
                    )
            length = headers.get(b"content-length", b"")
            if refused is None and length.isdigit() and int(length) > MAX_BODY_BYTES:
                refused = _body_too_large()
            if refused is not None:
                await refused(scope, receive, send)
                return
        await self.app(scope, receive, send)


# how often a non-streaming request checks that its client is still connected
DISCONNECT_POLL_S = 0.25
# on SIGTERM / SIGINT, how long responses still being written may take before they are cut
SHUTDOWN_GRACE_S = 2.0
# after the engine died, how long /health answers 503 with the cause before the server exits
DEAD_EXIT_DELAY_S = 1.0


class _Server(uvicorn.Server):
    """uvicorn's server, stopping as this one should on SIGTERM / SIGINT: open requests fail at
    once (a long prefill is not waited for) and the process exits 0. (uvicorn alone waits for
    every open request, then re-raises the signal: exit code -15 on SIGTERM.) A second signal
    skips the graceful part."""

    def __init__(self, config: uvicorn.Config, state: ServerState):
        super().__init__(config)
        self.state = state

    def handle_exit(self, sig: int, frame) -> None:
        self.state.stopping = True
        self.force_exit = self.should_exit
        self.should_exit = True

    async def shutdown(self, sockets=None) -> None:
        if self.state.stopping and self.state.engine is not None:
            self.state.engine.fail_open("the server is shutting down")
        await super().shutdown(sockets)


def _listen(host: str, port: int) -> socket.socket:
    """The server's socket, bound and listening before the engine starts."""
    if not 0 <= port <= 65535:
        raise OSError(0, "not a port number (0-65535)")
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT is no conflict
        sock.bind((host, port))
        sock.listen(2048)
    except BaseException:
        sock.close()
        raise
    return sock


def _bind_error(host: str, port: int, e: OSError) -> str:
    why = (e.strerror or str(e)).lower()
    if isinstance(e, socket.gaierror) or e.errno == errno.EADDRNOTAVAIL:
        return f"--host {host}: {why}"
    return f"--port {port}: {why}"  # in use, privileged, out of range


def _url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


async def _unless_disconnected(request: Request, coro):
    """Await a non-streaming handler, cancelling it (which aborts its engine requests) as soon
    as the client disconnects."""
    task = asyncio.ensure_future(coro)
    while True:
        done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
        if done:
            return task.result()
        if await request.is_disconnected():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            raise ClientDisconnected


def _body_too_large() -> JSONResponse:
    return _err(f"the request body is larger than {MAX_BODY_BYTES} bytes", 413, "RequestTooLarge")


def _err(message: str, code: int = 400, err_type: str = "BadRequestError") -> JSONResponse:
    return JSONResponse(error_body(message, err_type, code), status_code=code)


def build_app(state: ServerState) -> FastAPI:
    args = state.args

    @asynccontextmanager
    async def lifespan(app):
        freeze_gc_heap("API server")  # the engine is up: what exists now lives to the end
        yield
        if state.engine is not None:
            state.engine.shutdown()

    app = FastAPI(lifespan=lifespan)

    app.add_middleware(RequestGuard, api_key=args.api_key or os.environ.get("VLLM_API_KEY"))

    async def parse(request: Request, model):
        raw = await request.body()
        if len(raw) > MAX_BODY_BYTES:  # sent without a Content-Length
            raise BodyTooLarge
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"malformed JSON body: {e}") from e
        except RecursionError:
            raise ValueError("malformed JSON body: nested too deeply") from None
        if not isinstance(body, dict):
            raise ValueError("the request body must be a JSON object")
        try:
            return model.model_validate(body)
        except ValidationError as e:
            first = e.errors()[0]
            loc = ".".join(str(x) for x in first.get("loc", ()))
            raise ValueError(f"invalid request: {loc}: {first.get('msg')}") from e

    def request_id(request: Request) -> str:
        return request.headers.get("X-Request-Id") or new_request_id()

    def unavailable(e: Exception) -> JSONResponse:
        why = f"engine is dead: {e}" if state.engine.dead else str(e)  # or shutting down
        return _err(why, 503, "ServiceUnavailableError")

    async def run(request: Request, model, handler):
        if state.dead:
            return _err(f"engine is dead: {state.dead}", 503, "ServiceUnavailableError")
        try:
            req = await parse(request, model)
            bad = state.serving.check_model(req.model)
            if bad is not None:
                return JSONResponse(bad, status_code=404)
            rid = request_id(request)
            if req.stream:  # the stream's generator aborts the request when the client leaves
                result = await handler(req, rid, True)
            else:
                result = await _unless_disconnected(request, handler(req, rid, False))
        except EngineDeadError as e:
            return unavailable(e)
        except BodyTooLarge:
            return _body_too_large()
        except ClientDisconnected:  # nobody reads this; the request was aborted
            return Response(status_code=499)
        except (ValueError, TypeError) as e:
            return _err(str(e))
        headers = {"X-Request-Id": rid}
        if req.stream:
            return StreamingResponse(result, media_type="text/event-stream", headers=headers)
        return JSONResponse(result, headers=headers)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await run(request, CompletionRequest, state.serving.completion)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await run(request, ChatCompletionRequest, state.serving.chat)

    async def render(request: Request, model, handler):
        """Upstream's render endpoints: the token-in request(s) a body becomes, not run."""
        try:
            req = await parse(request, model)
            bad = state.serving.check_model(req.model)
            if bad is not None:
                return JSONResponse(bad, status_code=404)
            return JSONResponse(handler(req, request_id(request)))
        except BodyTooLarge:
            return _body_too_large()
        except (ValueError, TypeError) as e:
            return _err(str(e))

    @app.post("/v1/completions/render")
    async def render_completion(request: Request):
        return await render(request, CompletionRequest, state.serving.render_completion)

    @app.post("/v1/chat/completions/render")
    async def render_chat(request: Request):
        return await render(request, ChatCompletionRequest, state.serving.render_chat)

    @app.post("/tokenize")
    async def tokenize(request: Request):
        try:
            body = await request.json()
            if "messages" in body:
                p = state.serving.chat_prompt(ChatCompletionRequest.model_validate(body))
            else:
                p = state.engine.tokenize(body.get("prompt", ""))
        except (ValueError, ValidationError, json.JSONDecodeError) as e:
            return _err(str(e))
        mrl = state.engine.inputs.max_request_tokens
        return JSONResponse(
            {
                "tokens": p.prompt_token_ids.tolist(),
                "count": len(p.prompt_token_ids),
                "max_model_len": mrl,
            }
        )

    @app.get("/v1/models")
    async def models():
        mc = state.engine.config.model_config
        return JSONResponse(
            {
                "object": "list",
                "data": [
                    {
                        "id": state.serving.model_name,
                        "object": "model",
                        "created": int(time.time()),
                        "owned_by": "vllm",
                        "root": mc.model,
                        "parent": None,
                        "max_model_len": state.engine.inputs.max_request_tokens,
                    }
                ],
            }
        )

    @app.get("/health")
    async def health():
        if state.dead or state.engine is None or state.engine.dead:
            return Response(
                status_code=503, content=f"engine is dead: {state.dead or state.engine.dead}"
            )
        return Response(status_code=200)

    @app.get("/ping")
    async def ping():
        return await health()

    @app.get("/version")
    async def version():
        from vllm import __version__

        return JSONResponse({"version": __version__})

    @app.get("/metrics")
    async def metrics():
        return Response(
            state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8"
        )

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache():
        if state.dead:
            return _err(f"engine is dead: {state.dead}", 503, "ServiceUnavailableError")
        try:
            ok = await state.engine.utility("reset_prefix_cache")
        except EngineDeadError as e:
            return unavailable(e)
        except TimeoutError:
            return _err("the engine did not answer within 60 s", 503, "ServiceUnavailableError")
        # False: some cached blocks were in use on an engine (nothing changed there)
        return JSONResponse({"reset": all(ok)})

    return app


def run_server(args: argparse.Namespace) -> int:
    init_logging(args.uvicorn_log_level if args.uvicorn_log_level != "info" else None)
    engine_args = EngineArgs.from_cli_args(args)
    try:
        config = engine_args.create_engine_config()
        parsers = ChatParsers.from_args(args)
    except (ValueError, NotImplementedError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        sock = _listen(args.host, args.port)
    except OSError as e:
        print(f"error: {_bind_error(args.host, args.port, e)}", file=sys.stderr)
        return 1
    url = _url(args.host, sock.getsockname()[1])
    state = ServerState(args)
    spec = config.speculative_config
    state.metrics = Metrics(
        config.model_config.served_model_name,
        config.num_spec_tokens,
        spec.synthetic_acceptance_length if spec is not None else None,
    )
    state.server = _server(state, sock.getsockname()[1])

    def on_dead(why: str) -> None:
        if state.stopping:  # the engine processes were told to stop, or killed
            return
        state.dead, state.exit_code = why, 1
        threading.Thread(target=exit_soon, name="exit-on-death", daemon=True).start()

    def exit_soon() -> None:
        time.sleep(DEAD_EXIT_DELAY_S)
        state.server.should_exit = True

    logger.info("listening on %s; starting engine for %s", url, config.model_config.model)
    signal.signal(signal.SIGTERM, _interrupt)  # as SIGINT until uvicorn takes the signals over
    try:
        try:
            state.engine = AsyncLLM(config, state.metrics, on_dead)
        except Exception as e:  # noqa: BLE001
            print(f"error: engine failed to start: {e}", file=sys.stderr)
            return 1
        if args.chat_template and state.engine.tokenizer is not None:
            t = args.chat_template
            state.engine.tokenizer.chat_template = open(t).read() if os.path.isfile(t) else t
        state.serving = OpenAIServing(
            state.engine,
            config.model_config.served_model_name,
            args.enable_prompt_tokens_details,
            parsers,
        )
        logger.info("serving %s on %s", config.model_config.served_model_name, url)
        asyncio.run(state.server.serve(sockets=[sock]))
    except KeyboardInterrupt:  # SIGINT / SIGTERM before the server took the signals over
        state.stopping = True
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):  # the shutdown below takes a few seconds
            signal.signal(sig, signal.SIG_IGN)
        sock.close()
        if state.engine is not None:
            state.engine.shutdown()
    if state.dead:
        print(f"error: engine died: {state.dead}", file=sys.stderr)
    return state.exit_code


def _interrupt(sig: int, frame) -> None:
    raise KeyboardInterrupt


def _server(state: ServerState, port: int) -> _Server:
    args = state.args
    uv = uvicorn.Config(
        build_app(state),
        host=args.host,
        port=port,
        log_level=args.uvicorn_log_level,
        access_log=not args.disable_uvicorn_access_log,
        timeout_keep_alive=5,
        timeout_graceful_shutdown=SHUTDOWN_GRACE_S,
        lifespan="on",
    )
    return _Server(uv, state)


def add_server_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=8000, help="0: a free port the OS picks")
    g.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/*")
    g.add_argument(
        "--enable-prompt-tokens-details",
        action="store_true",
        help="report usage.prompt_tokens_details.cached_tokens",
    )
    g.add_argument(
        "--uvicorn-log-level",
        default="info",
        choices=["debug", "info", "warning", "error", "critical"],
    )
    g.add_argument(
        "--disable-uvicorn-access-log", action="store_true", help="no log line per HTTP request"
    )
    g.add_argument("--chat-template", default=None, help="a Jinja chat template file or string")
    add_chat_parser_args(g)
    g.add_argument("--disable-log-requests", action="store_true")
