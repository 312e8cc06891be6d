"""
The chat server behind `python -m scripts.chat_web`: the FastAPI app over a pool of worker processes
(nanochat/serving/workers.py), with the browser UI, its streaming endpoint, the OpenAI API
(nanochat/serving/openai_api.py), /health and /stats, and the API keys that guard them; then what keeps it serving
under hostile load: a bound on open connections that a flood of idle sockets or of clients that never read cannot
fill, replies judged by what their clients take, a client past the bound told to retry rather than cut off, a
file-descriptor limit raised to what the system allows, and checks on every request that a web page in the user's
browser cannot pass (a JSON body, and a Host header naming this server, which DNS rebinding cannot fake). What one
client may hold of the workers is workers.WorkerPool's.
"""

import asyncio
import fcntl
import hmac
import ipaddress
import os
import re
import resource
import socket
import struct
import termios
import time
from collections import OrderedDict
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from uvicorn.protocols.http.h11_impl import H11Protocol

from nanochat.common import UserError, print0
from nanochat.serving.chat import RequestError, fit_conversation, prompt_budget, validate_messages
from nanochat.serving.events import Failure, Finish, Piece
from nanochat.serving.openai_api import (CLIENT_SCOPE_KEY, SSE_HEADERS, ClientGone, HTTPProblem, OpenAIRoutes,
                                         check_bool, check_model, client_of, openai_error, openai_usage, read_json_body,
                                         read_sampling, sse, until_disconnect)
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
        generation = await until_disconnect(request, self.pool.submit(prompt.ids, sampling, client=client_of(request)))
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
                elif isinstance(event, Failure):
                    out.append(sse({"error": event.reason}))
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
    ASGI wrapper: every request but OPEN_PATHS needs `Authorization: Bearer KEY` with one of the server's keys,
    compared in constant time; others get a 401 in the API's error shape, and a request with two Authorization headers
    a 400 (which one counts would be up to whoever reads them). Where the server has several keys, the key names the
    client (openai_api.client_of: what one client may hold). Plain ASGI rather than an HTTP middleware, which would
    buffer the streamed replies and hide a client's disconnect from them.
    """

    def __init__(self, app, keys):
        self.app, self.keys = app, [key.encode() for key in keys]

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            headers = [value for name, value in scope["headers"] if name == b"authorization"]
            if len(headers) > 1:
                response = JSONResponse(openai_error(f"{len(headers)} Authorization headers: send one",
                                                     "invalid_request_error"), status_code=400)
                return await response(scope, receive, send)
            header = headers[0] if headers else b""
            scheme, _, given = header.partition(b" ")
            # every key compared, whatever matched: the time taken says nothing of which key came close
            matches = [hmac.compare_digest(given.strip(), key) for key in self.keys]
            if scheme.lower() != b"bearer" or not any(matches):
                reason = "missing" if not header else "wrong"
                error = openai_error(f"{reason} API key: send the header `Authorization: Bearer <key>` with a key the "
                                     "server was started with (--api-key)", "invalid_request_error")
                error["error"]["code"] = "invalid_api_key"
                response = JSONResponse(error, status_code=401, headers={"WWW-Authenticate": "Bearer"})
                return await response(scope, receive, send)
            if len(self.keys) > 1:
                scope[CLIENT_SCOPE_KEY] = f"key {matches.index(True) + 1}"
        return await self.app(scope, receive, send)


def create_app(pool, tokenizer, model_info, defaults, api_keys=(), allowed_hosts=("127.0.0.1", "localhost", "::1"),
               connections=None):
    """
    The app around a pool of workers. defaults: temperature, top_k, max_tokens of requests that omit them; api_keys:
    the keys every route but OPEN_PATHS requires one of (RequireKey), or none; allowed_hosts: the names a request's
    Host header may give (allowed_host_names below), or None for any; connections: a function giving the connections'
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
        body = {"status": "ok" if alive else "no worker alive", "workers": alive, "auth_required": bool(api_keys),
                "model": model_info}
        return body if alive else JSONResponse(body, status_code=503)

    async def stats():
        return {**pool.stats(), **({"connections": connections()} if connections else {})}

    app.get("/")(ui)
    app.get("/health")(health)
    app.get("/stats")(stats)
    app.post("/chat/completions")(ui_routes.ui_completion)
    OpenAIRoutes(pool, tokenizer, model_info, defaults).mount(app)
    return AnswerOverBound(RequireJSONAndHost(RequireKey(app, api_keys) if api_keys else app, allowed_hosts))


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
WRITE_TIMEOUT = 30.0  # seconds a reply may go without its client taking STALL_BYTES before the connection is closed
LOOPBACK = ("127.0.0.1", "localhost", "::1")
# A reply "moves" while its client takes at least this many bytes per window (--write-timeout to keep its connection,
# EVICT_WINDOW to keep it when a new connection needs its slot). Counted as the client's TCP acknowledges them, not as
# asyncio hands them to the kernel: Linux wakes a writer only once a third of a full send buffer (up to 4 MB) is free,
# so a client reading a steady 40 KB/s looked, to asyncio, like one that read nothing for half a minute
STALL_BYTES = 16384
EVICT_WINDOW = 5.0
OVER_BOUND_SCOPE_KEY = "nanochat.over_bound"  # set on a request that came in past --max-connections


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
    pipes, the connections let in past the bound (over_bound_connections), and the batches of up to 128 connections
    (the backlog) asyncio accepts before the guard sees them, while the ones it evicted are still closing: half the
    limit, at least 256 files, in reserve (with 256, a flood under a 1,024-file limit ran the server out of files now
    and then)."""
    return max(16, min(4096, open_files - max(256, open_files // 2)))


def over_bound_connections(max_connections):
    """Connections let in past max_connections when every one of those holds a request in progress: each is answered
    once (/health, or a 503 with Retry-After) and closed. A sixteenth of the bound, at least 16: 32 of the reserve's
    256 files under a 1,024-file limit."""
    return max(16, max_connections // 16)


def unsent_bytes(transport):
    """Bytes the kernel holds for this connection that its client has not acknowledged yet (Linux's SIOCOUTQ); 0 where
    the system does not say."""
    sock = transport.get_extra_info("socket")
    if sock is None or not hasattr(termios, "TIOCOUTQ"):
        return 0
    try:
        return struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0" * 4))[0]
    except OSError:
        return 0


class CountingTransport:
    """A connection's transport that counts what the server wrote to it: less what still waits for the client
    (waiting()), what the client has taken."""

    def __init__(self, transport):
        self.transport, self.written = transport, 0

    def write(self, data):
        self.written += len(data)
        self.transport.write(data)

    def waiting(self):
        """Bytes written that the client has not taken: in asyncio's buffer, or unacknowledged in the kernel's."""
        return self.transport.get_write_buffer_size() + unsent_bytes(self.transport)

    def __getattr__(self, name):  # everything else is the transport's own
        return getattr(self.transport, name)


class ConnectionGuard:
    """
    The server's open connections, at most max_connections, and what their clients do with them.

    A connection has header_timeout seconds to send a whole request, headers and body (one that sends nothing, or its
    headers or body a byte at a time, is closed); one that waits for its next request is closed by uvicorn's
    keep-alive timeout, or by this one if it starts a request and does not finish it. From a whole request until the
    last of its reply has left asyncio's buffer, the connection is judged by what its client takes, counted once a
    second (tick): a client that has bytes waiting (in asyncio's buffer or the kernel's) and took fewer than STALL_BYTES
    of them in write_timeout seconds is closed, which cancels the reply and frees its row and memory. That includes a
    stream small enough for the buffers, whose client never reads it (asyncio never pauses such a writer).

    When max_connections are open, a new connection closes the one that has waited longest for a request, else the
    reply whose client has taken fewer than STALL_BYTES for the longest (at least EVICT_WINDOW seconds): a reply that
    moves is never cut. If every connection holds a request that is moving, the new one is let in past the bound (at
    most over_bound_connections of them) to be answered once, /health as always and any other request with a 503 and
    Retry-After (AnswerOverBound), and closed: a client is always answered, at worst told to retry.
    """

    def __init__(self, max_connections, header_timeout=HEADER_TIMEOUT, write_timeout=WRITE_TIMEOUT):
        self.max_connections, self.header_timeout, self.write_timeout = max_connections, header_timeout, write_timeout
        self.max_over_bound = over_bound_connections(max_connections)
        self.evict_window = min(EVICT_WINDOW, write_timeout)
        self.idle = OrderedDict()  # protocol -> since when it has waited for a complete request, oldest first
        self.busy = set()  # a request in, or its reply still going out
        self.moved = {}  # busy protocol -> (when its client last took STALL_BYTES or had nothing waiting, bytes taken)
        self.over_bound = set()  # let in past max_connections, to be answered once
        self.closed_idle = self.closed_stalled = self.let_in_over_bound = 0
        self.ticking = False

    def protocol_class(self):
        guard = self

        class GuardedH11Protocol(H11Protocol):
            def connection_made(self, transport):
                super().connection_made(transport)
                self.transport = CountingTransport(transport)  # uvicorn writes every response through it
                guard.opened(self)

            def data_received(self, data):
                super().data_received(data)
                if self in guard.over_bound and self.scope is not None:  # the app has not seen the request yet
                    self.scope[OVER_BOUND_SCOPE_KEY] = True
                if guard.serving(self):
                    guard.started(self)

            def on_response_complete(self):
                super().on_response_complete()
                guard.response_complete(self)

            def connection_lost(self, exc):
                guard.lost(self)
                super().connection_lost(exc)

        return GuardedH11Protocol

    @staticmethod
    def serving(protocol):
        """A whole request (headers and body) is in and its response not complete yet."""
        cycle = protocol.cycle
        return cycle is not None and not cycle.more_body and not cycle.response_complete

    @staticmethod
    def delivered(protocol):
        """Its response is complete and none of it waits in asyncio's buffer (the kernel sends the rest even after a
        close)."""
        cycle = protocol.cycle
        return cycle is not None and cycle.response_complete and not protocol.transport.get_write_buffer_size()

    def opened(self, protocol):
        if len(self.idle) + len(self.busy) >= self.max_connections:
            idle = next(iter(self.idle), None)
            stalled = self.longest_stalled() if idle is None else None
            if idle is not None:  # closed at once: its file is what the new connection needs
                self.closed_idle += 1
                self.close(idle)
            elif stalled is not None:
                self.closed_stalled += 1
                self.close(stalled)
            elif len(self.over_bound) < self.max_over_bound:
                self.over_bound.add(protocol)
                self.let_in_over_bound += 1
            else:  # as many let in past the bound as it allows, each with its request in: no file to spare
                self.close(protocol)
                return
        self.wait_for_request(protocol)

    def stats(self):
        """For /stats: connections open, those whose client has taken nothing for the eviction window, and how many
        were closed for sending no request or taking no reply, or let in past the bound to be answered once."""
        now = self.progress()
        stalled = sum(now - since >= self.evict_window for since, _ in self.moved.values())
        return {"open": len(self.idle) + len(self.busy), "busy": len(self.busy), "stalled": stalled,
                "closed_idle": self.closed_idle, "closed_stalled": self.closed_stalled,
                "let_in_over_bound": self.let_in_over_bound}

    def close(self, protocol):
        self.lost(protocol)
        protocol.transport.abort()

    # -- requests ---------------------------------------------------------------------------------

    def wait_for_request(self, protocol):
        since = time.monotonic()
        self.idle[protocol] = since
        self.idle.move_to_end(protocol)
        protocol.loop.call_later(self.header_timeout, self.expire, protocol, since)

    def expire(self, protocol, since):
        """Still no complete request since `since`: closed (a flood's socket, slow headers, a slow body)."""
        if self.idle.get(protocol) == since:
            self.close(protocol)
            self.closed_idle += 1

    def started(self, protocol):
        """A whole request is in: the connection is busy, and its client's progress is watched."""
        self.idle.pop(protocol, None)
        self.busy.add(protocol)
        transport = protocol.transport
        self.moved.setdefault(protocol, (time.monotonic(), transport.written - transport.waiting()))
        if not self.ticking:
            self.ticking = True
            protocol.loop.call_later(self.tick_seconds(), self.tick, protocol.loop)

    def response_complete(self, protocol):
        """The app has written its whole response: the connection waits for its next request once the last bytes have
        left asyncio's buffer (until then it stays busy, and the tick looks again)."""
        if protocol.transport.is_closing() or self.serving(protocol):  # closing, or a pipelined request began
            return
        if self.delivered(protocol):
            self.busy.discard(protocol)
            self.moved.pop(protocol, None)
            self.wait_for_request(protocol)

    def lost(self, protocol):
        self.idle.pop(protocol, None)
        self.busy.discard(protocol)
        self.moved.pop(protocol, None)
        self.over_bound.discard(protocol)

    # -- what clients take of their replies -------------------------------------------------------

    def tick_seconds(self):
        return min(1.0, self.write_timeout / 2)

    def progress(self):
        """Moves the mark of every busy connection whose client has nothing waiting or took STALL_BYTES since its
        mark; returns now."""
        now = time.monotonic()
        for protocol, (since, taken) in list(self.moved.items()):
            waiting = protocol.transport.waiting()
            taken_now = protocol.transport.written - waiting
            if not waiting or taken_now - taken >= STALL_BYTES:
                self.moved[protocol] = (now, taken_now)
        return now

    def tick(self, loop):
        """Every second while connections are busy: one whose reply's last bytes have left asyncio's buffer waits for
        the next request; one whose client took fewer than STALL_BYTES of what waits for it in write_timeout seconds is
        closed (its generation is cancelled when the app sees the disconnect)."""
        now = self.progress()
        for protocol, (since, _) in list(self.moved.items()):
            if self.delivered(protocol):
                self.response_complete(protocol)
            elif now - since >= self.write_timeout:
                self.close(protocol)
                self.closed_stalled += 1
                print0(f"closed a connection whose client took less than {STALL_BYTES // 1024} KiB of its reply in "
                       f"{self.write_timeout:g} s (--write-timeout)")
        self.ticking = bool(self.moved)
        if self.ticking:
            loop.call_later(self.tick_seconds(), self.tick, loop)

    def longest_stalled(self):
        """The reply whose client has gone longest without taking STALL_BYTES, if at least evict_window; else None."""
        now = self.progress()
        stalled = [(since, id(p), p) for p, (since, _) in self.moved.items() if now - since >= self.evict_window]
        return min(stalled)[2] if stalled else None


class AnswerOverBound:
    """
    ASGI wrapper for a request on a connection let in past --max-connections (ConnectionGuard): /health is answered as
    always, any other request gets a 503 with Retry-After, and the connection is closed after either. So a client
    finds out that it should come back, where it was cut off without a word.
    """

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not scope.get(OVER_BOUND_SCOPE_KEY):
            return await self.app(scope, receive, send)

        async def send_and_close(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (b"connection", b"close")]}
            await send(message)

        if scope["path"] == "/health":
            return await self.app(scope, receive, send_and_close)
        error = openai_error("every connection this server keeps open (--max-connections) holds a request in progress; "
                             "try again shortly", "server_busy")
        response = JSONResponse(error, status_code=503, headers={"Retry-After": "1"})
        return await response(scope, receive, send_and_close)


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


HOST_HEADER = re.compile(r"\[(?P<address>[0-9a-f:.]+)\](:\d*)?|(?P<name>[^\[\]:]+)(:\d*)?")


def host_name(header):
    """The name in a Host header, without its port: "[::1]:8000" -> "::1", "Example.org:80" -> "example.org"; None
    for a header that is not a name or a bracketed address with an optional port ("[::1].evil.com", "::1")."""
    match = HOST_HEADER.fullmatch(header.lower())
    return match and (match["address"] or match["name"])


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
                if host_name(host) not in self.allowed or sum(name == b"host" for name, _ in scope["headers"]) > 1:
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
