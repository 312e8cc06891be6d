"""
The chat server behind `python -m scripts.chat_web`: the FastAPI app over a pool of worker processes
(nanochat/serving/workers.py), with the browser UI, its streaming endpoint, the OpenAI API
(nanochat/serving/openai_api.py), /health and /stats, and the API key that guards them; then what keeps it serving
under hostile load: a bound on open connections that a flood of idle sockets or of clients that never read cannot
fill, a file-descriptor limit raised to what the system allows, and checks on every request that a web page in the
user's browser cannot pass (a JSON body, and a Host header naming this server, which DNS rebinding cannot fake).
"""

import asyncio
import hmac
import ipaddress
import os
import resource
import socket
import time
from collections import OrderedDict
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from uvicorn.protocols.http.h11_impl import H11Protocol

from nanochat.common import UserError, print0
from nanochat.serving.chat import Finish, Piece, RequestError, fit_conversation, prompt_budget, validate_messages
from nanochat.serving.openai_api import (SSE_HEADERS, ClientGone, HTTPProblem, OpenAIRoutes, check_bool, check_model,
                                         openai_error, openai_usage, read_json_body, read_sampling, sse,
                                         until_disconnect)
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
            return "".join(out)  # the None at the end flushed the last run of pieces

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
    may give (allowed_host_names below), or None for any; connections: a function giving the connections'
    counts for /stats (ConnectionGuard.stats below).
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


# -----------------------------------------------------------------------------
# Hostile load: connections, open files, what a browser's page cannot send

HEADER_TIMEOUT = 10.0  # seconds a new connection has to send a whole request's headers
WRITE_TIMEOUT = 30.0  # seconds a reply may wait for its client to read before the connection is closed
LOOPBACK = ("127.0.0.1", "localhost", "::1")


def raise_open_file_limit():
    """Raise this process's open-file limit to the hard limit (each connection is a file); returns the new soft
    limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard if hard != resource.RLIM_INFINITY else 1 << 20, hard))
        except (ValueError, OSError):
            pass
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def default_max_connections(open_files):
    """Connections the server keeps open at once: room below the open-file limit for the model's files, the workers'
    pipes, and the batches of up to 128 connections (the backlog) asyncio accepts before the guard sees them, while
    the ones it evicted are still closing: half the limit, at least 256 files, in reserve (with 256, a flood under a
    1,024-file limit ran the server out of files now and then)."""
    return max(16, min(4096, open_files - max(256, open_files // 2)))


class ConnectionGuard:
    """
    The server's open connections, at most max_connections. A connection has header_timeout seconds to send a whole
    request, headers and body (one that sends nothing, or its headers or body a byte at a time, is closed); one that
    waits for its next request is closed by uvicorn's keep-alive timeout, or by this one if it starts a request and
    does not finish it. A reply whose client stops reading (the socket's buffers full: writing paused) has
    write_timeout seconds to move again, or its connection is closed, which cancels the reply and frees its row and
    memory. Only a connection whose whole request is in counts as busy: when the bound is reached, a new connection
    closes the one that has waited longest without a complete request, else the one whose reply has waited longest on
    a client that does not read, or itself if every one is busy and moving, so idle, slow and stalled sockets cannot
    keep a client with a request out.
    """

    def __init__(self, max_connections, header_timeout=HEADER_TIMEOUT, write_timeout=WRITE_TIMEOUT):
        self.max_connections, self.header_timeout, self.write_timeout = max_connections, header_timeout, write_timeout
        self.idle = OrderedDict()  # protocol -> since when it has waited for a complete request, oldest first
        self.busy = set()
        self.stalled = OrderedDict()  # protocol -> since when its reply has waited for the client to read, oldest first
        self.closed_idle = self.closed_stalled = 0

    def protocol_class(self):
        guard = self

        class GuardedH11Protocol(H11Protocol):
            def connection_made(self, transport):
                super().connection_made(transport)
                guard.opened(self)

            def data_received(self, data):
                super().data_received(data)
                if guard.serving(self):
                    guard.started(self)

            def on_response_complete(self):
                super().on_response_complete()
                guard.waiting(self)

            def pause_writing(self):
                super().pause_writing()
                guard.write_paused(self)

            def resume_writing(self):
                super().resume_writing()
                guard.stalled.pop(self, None)

            def connection_lost(self, exc):
                guard.lost(self)
                super().connection_lost(exc)

        return GuardedH11Protocol

    @staticmethod
    def serving(protocol):
        """A whole request (headers and body) is in and its response not complete yet."""
        cycle = protocol.cycle
        return cycle is not None and not cycle.more_body and not cycle.response_complete

    def opened(self, protocol):
        if len(self.idle) + len(self.busy) >= self.max_connections:
            victim = next(iter(self.idle), None) or next(iter(self.stalled), None) or protocol
            if victim in self.stalled:
                self.closed_stalled += 1
            else:
                self.closed_idle += 1
            self.lost(victim)
            victim.transport.abort()  # at once: its file is what the new connection needs
            if victim is protocol:
                return
        self.wait_for_request(protocol)

    def stats(self):
        """For /stats: connections open, and how many were closed for sending no request or reading no reply."""
        return {"open": len(self.idle) + len(self.busy), "busy": len(self.busy), "stalled": len(self.stalled),
                "closed_idle": self.closed_idle, "closed_stalled": self.closed_stalled}

    def write_paused(self, protocol):
        since = time.monotonic()
        self.stalled[protocol] = since
        protocol.loop.call_later(self.write_timeout, self.expire_write, protocol, since)

    def expire_write(self, protocol, since):
        """Its reply has not moved since `since`: closed (the reply is cancelled when the app sees the disconnect)."""
        if self.stalled.get(protocol) == since:
            self.lost(protocol)
            protocol.transport.abort()
            self.closed_stalled += 1
            print0(f"closed a connection whose client read nothing of its reply for {self.write_timeout:g} s "
                   "(--write-timeout)")

    def wait_for_request(self, protocol):
        since = time.monotonic()
        self.idle[protocol] = since
        self.idle.move_to_end(protocol)
        protocol.loop.call_later(self.header_timeout, self.expire, protocol, since)

    def expire(self, protocol, since):
        """Still no complete request since `since`: closed (a flood's socket, slow headers, a slow body)."""
        if self.idle.get(protocol) == since:
            self.lost(protocol)
            protocol.transport.abort()
            self.closed_idle += 1

    def started(self, protocol):
        self.idle.pop(protocol, None)
        self.busy.add(protocol)

    def waiting(self, protocol):
        self.busy.discard(protocol)
        if protocol.transport.is_closing() or self.serving(protocol):  # closing, or a pipelined request began
            if self.serving(protocol):
                self.busy.add(protocol)
            return
        self.wait_for_request(protocol)

    def lost(self, protocol):
        self.idle.pop(protocol, None)
        self.busy.discard(protocol)
        self.stalled.pop(protocol, None)


def local_addresses():
    """This machine's own addresses, as far as it can tell without asking the network: its host name's, and on
    Linux every interface's (the kernel's tables)."""
    addresses = set()
    for name in {socket.gethostname(), socket.getfqdn()}:
        try:
            addresses |= {info[4][0] for info in socket.getaddrinfo(name, None)}
        except OSError:
            pass
    try:
        with open("/proc/net/fib_trie") as f:
            last = None
            for line in f:
                if "|--" in line:
                    last = line.split("|--")[1].strip()
                elif "/32 host LOCAL" in line and last:
                    addresses.add(last)
    except OSError:
        pass
    try:
        with open("/proc/net/if_inet6") as f:
            addresses |= {ipaddress.IPv6Address(int(line.split()[0], 16)).compressed for line in f if line.strip()}
    except (OSError, ValueError):
        pass
    return addresses


def allowed_host_names(host, extra=()):
    """
    The names a request's Host header may give for a server bound to `host`: the loopback names, the bound address,
    and for an address other than loopback this machine's names and addresses (every one for 0.0.0.0 or ::), plus
    `extra` (--allowed-hosts). A web page that rebinds its own name to this machine's address still sends its own
    name, so it is refused.
    """
    names = set(LOOPBACK) | {host.strip("[]").lower()} | {name.strip("[]").lower() for name in extra}
    if host not in LOOPBACK:
        names |= {socket.gethostname().lower(), socket.getfqdn().lower()} | local_addresses()
    return sorted(names - {"", "0.0.0.0", "::"})


def host_name(header):
    """The name in a Host header, without its port: "[::1]:8000" -> "::1", "Example.org:80" -> "example.org"."""
    if header.startswith("["):
        return header[1:].split("]")[0].lower()
    return (header.rsplit(":", 1)[0] if header.count(":") == 1 else header).lower()


class RequireJSONAndHost:
    """
    ASGI wrapper against a web page the user visits: a POST must carry a JSON body (a page can send text/plain across
    origins without asking; application/json it cannot), and the Host header must name this server (allowed_hosts;
    None: any name, for a server a key guards), since a page that rebinds its own host name to this machine's address
    sends its own name. 415 and 421 in the API's error shape.
    """

    def __init__(self, app, allowed_hosts):
        self.app = app
        self.allowed = None if allowed_hosts is None else set(allowed_hosts)

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            headers = dict(scope["headers"])
            problem = None
            if self.allowed is not None:
                host = headers.get(b"host", b"").decode("latin-1")
                if host_name(host) not in self.allowed:
                    problem = (421, f"Host {host!r:.100} is not this server: it answers to "
                                    f"{', '.join(sorted(self.allowed))} (a web page may not reach it under another name; "
                                    "chat_web --allowed-hosts adds names)")
            if problem is None and scope["method"] == "POST":
                kind = headers.get(b"content-type", b"").split(b";")[0].strip().lower()
                if kind != b"application/json":
                    problem = (415, f"the body must be JSON, sent with Content-Type: application/json (got "
                                    f"{kind.decode('latin-1') or 'none'!r})")
            if problem:
                response = JSONResponse(openai_error(problem[1], "invalid_request_error"), status_code=problem[0])
                return await response(scope, receive, send)
        return await self.app(scope, receive, send)
