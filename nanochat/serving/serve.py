"""
The chat server behind `python -m scripts.chat_web`: the FastAPI app over a pool of worker processes
(nanochat/serving/workers.py), with the browser UI, its streaming endpoint, the OpenAI API (nanochat/serving/openai_api.py), /health
and /stats, and the API key that guards them.
"""

import asyncio
import hmac
import os
import socket

from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from nanochat.common import UserError
from nanochat.serving.chat import Finish, Piece, RequestError, fit_conversation, prompt_budget, validate_messages
from nanochat.serving.openai_api import (SSE_HEADERS, ClientGone, HTTPProblem, OpenAIRoutes, check_bool, check_model, openai_error,
                                         openai_usage, read_json_body, read_sampling, sse, until_disconnect)
from nanochat.serving.server_guard import RequireJSONAndHost
from nanochat.serving.workers import NoWorkerAlive, QueueTimeout, ServerStopping

UI_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ui.html")


class UIRoutes:
    """The browser UI's own endpoint: its conversation trimmed to fit the context (and told so), its reply streamed as
    text and tool parts."""

    def __init__(self, pool, tokenizer, model_info, defaults):
        self.pool, self.tokenizer, self.defaults, self.context = pool, tokenizer, defaults, model_info["context"]
        self.model_id = model_info["id"]

    async def ui_completion(self, request: Request):
        """POST /chat/completions: the UI's stream of {"token"}, {"python"}, {"python_output"} ..., then {"done"}."""
        body = await read_json_body(request)
        unknown = sorted(set(body) - {"messages", "temperature", "top_k", "top_p", "max_tokens", "seed", "stop", "n",
                                      "model", "stream"})
        if unknown:
            raise RequestError(unknown[0], "is not a field of this endpoint (the OpenAI API is at /v1)")
        check_model(body, self.model_id)
        check_bool(body, "stream")  # it always streams; a client that says so must say it as a boolean
        messages = validate_messages(body.get("messages"))
        d = self.defaults
        sampling = read_sampling(body, d["temperature"], d["top_k"], d["max_tokens"])
        if sampling.num_samples != 1:
            raise RequestError("n", "this endpoint streams one reply; ask /v1/chat/completions for several")
        budget = prompt_budget(self.context, sampling.max_tokens)
        prompt = await asyncio.to_thread(fit_conversation, self.tokenizer, messages, budget)  # trimmed, and told so
        generation = await until_disconnect(request, self.pool.submit(prompt.ids, sampling))
        kinds = {"text": "token", "python": "python", "python_output": "python_output"}

        def as_sse(events):
            """One write for a batch of events; consecutive pieces of one kind go out as one event."""
            out, kind, text = [], None, ""
            for event in events + [None]:
                if isinstance(event, Piece) and (event.kind == kind or kind is None):
                    kind, text = event.kind, text + event.text
                    continue
                if kind is not None:
                    out.append(sse({kinds[kind]: text}))
                    kind, text = None, ""
                if isinstance(event, Piece):
                    kind, text = event.kind, event.text
                elif isinstance(event, Finish):
                    usage = openai_usage(len(prompt.ids), event.completion_tokens)
                    out.append(sse({"done": True, "finish_reason": event.reason, "usage": usage}))
                elif event is not None:
                    out.append(sse({"error": event}))
            if kind is not None:
                out.append(sse({kinds[kind]: text}))
            return "".join(out)

        async def stream():
            # A client that leaves mid-stream makes the response stop this generator (Starlette watches for the
            # disconnect); the finally then frees its row at the worker's next step.
            try:
                if prompt.note:
                    yield sse({"note": prompt.note})
                async for events in generation.event_batches():
                    yield as_sse(events)
            finally:
                generation.cancel()

        return StreamingResponse(stream(), media_type="text/event-stream", headers=SSE_HEADERS)


# The page may not be framed by another site (clickjacking), reads and sends only to this server, and runs only its
# own inline script and style
UI_HEADERS = {"X-Frame-Options": "DENY", "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer",
              "Content-Security-Policy": "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
                                         "connect-src 'self'; img-src 'self' data:; base-uri 'none'; "
                                         "form-action 'none'; frame-ancestors 'none'"}
OPEN_PATHS = ("/", "/health")  # the UI's page (it holds no model access: it asks for the key) and monitoring


class RequireKey:
    """
    ASGI wrapper: every request but OPEN_PATHS needs `Authorization: Bearer KEY`, compared in constant time; others get
    a 401 in the API's error shape. Plain ASGI rather than an HTTP middleware, which would buffer the streamed replies
    and hide a client's disconnect from them.
    """

    def __init__(self, app, key):
        self.app, self.key = app, key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            header = dict(scope["headers"]).get(b"authorization", b"")
            scheme, _, given = header.partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(given.strip(), self.key):
                reason = "missing" if not header else "wrong"
                error = openai_error(f"{reason} API key: send the header `Authorization: Bearer <key>` with the key the "
                                     "server was started with (--api-key)", "invalid_request_error")
                error["error"]["code"] = "invalid_api_key"
                response = JSONResponse(error, status_code=401, headers={"WWW-Authenticate": "Bearer"})
                return await response(scope, receive, send)
        return await self.app(scope, receive, send)


def create_app(pool, tokenizer, model_info, defaults, api_key=None, allowed_hosts=("127.0.0.1", "localhost", "::1"),
               connections=None):
    """
    The app around a pool of workers. defaults: temperature, top_k, max_tokens of requests that omit them; api_key:
    a key every route but OPEN_PATHS requires (RequireKey), or None; allowed_hosts: the names a request's Host header
    may give (server_guard.allowed_host_names), or None for any; connections: a function giving the connections'
    counts for /stats (server_guard.ConnectionGuard.stats).
    """
    ui_routes = UIRoutes(pool, tokenizer, model_info, defaults)
    with open(UI_PATH, encoding="utf-8") as f:
        ui_html = f.read()

    @asynccontextmanager
    async def lifespan(app):
        pool.start()
        yield
        pool.stop()

    app = FastAPI(title="nanochat", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(RequestError)
    async def bad_request(request, e):
        return JSONResponse(openai_error(str(e), "invalid_request_error", e.field, e.code), status_code=400)

    @app.exception_handler(HTTPProblem)
    async def http_problem(request, e):
        return JSONResponse(openai_error(e.message, e.kind, e.param, e.code), status_code=e.status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, e):  # an unknown path or method: in the API's error shape too, not {"detail": ...}
        return JSONResponse(openai_error(str(e.detail), "invalid_request_error"), status_code=e.status_code,
                            headers=getattr(e, "headers", None))

    @app.exception_handler(QueueTimeout)
    async def busy(request, e):
        return JSONResponse(openai_error(str(e), "server_busy"), status_code=503, headers={"Retry-After": "1"})

    @app.exception_handler(NoWorkerAlive)
    @app.exception_handler(ServerStopping)
    async def unavailable(request, e):
        return JSONResponse(openai_error(str(e), "server_error"), status_code=503)

    @app.exception_handler(ClientGone)
    async def gone(request, e):  # nobody reads it: the client left while its request waited
        return Response(status_code=499)

    async def ui():
        return HTMLResponse(ui_html, headers=UI_HEADERS)

    async def health():
        alive = sum(1 for w in pool.workers if w.alive)
        body = {"status": "ok" if alive else "no worker alive", "workers": alive, "auth_required": api_key is not None,
                "model": model_info}
        return body if alive else JSONResponse(body, status_code=503)

    async def stats():
        return {**pool.stats(), **({"connections": connections()} if connections else {})}

    app.get("/")(ui)
    app.get("/health")(health)
    app.get("/stats")(stats)
    app.post("/chat/completions")(ui_routes.ui_completion)
    OpenAIRoutes(pool, tokenizer, model_info, defaults).mount(app)
    return RequireJSONAndHost(RequireKey(app, api_key) if api_key else app, allowed_hosts)


# -----------------------------------------------------------------------------
# Starting up


def bind_socket(host, port):
    """Bind before loading the model, so a busy port is reported at once. A forked worker closes its copy at once:
    otherwise a server that died would leave its port held (connections hanging) until every worker noticed."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError as e:
        raise UserError(f"cannot listen on {host}:{port} ({e.strerror or e}); pick another --port or --host") from None
    os.register_at_fork(after_in_child=sock.close)
    return sock
