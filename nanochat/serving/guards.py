"""
chat_web's defences, around the app (serve.create_app) and its connections, kept apart from the protocol and the
routes: the API keys (RequireKey) and who a request comes from (client_of); the Host and JSON checks against web pages
(RequireJSONAndHost, allowed_host_names); bounded connections judged by what their clients take of their replies
(ConnectionGuard, CountingTransport), those let in past the bound answered once (AnswerOverBound); and the socket and
open-file limit set up before the model loads. docs/serving.md, "Under hostile load", has what each is against.
"""

import hmac
import ipaddress
import os
import re
import socket
import struct
import time
from collections import OrderedDict

from uvicorn.protocols.http.h11_impl import H11Protocol

from nanochat.common import UserError, print0
from nanochat.serving.protocol import error_response

try:  # POSIX: the open-file limit
    import resource
except ImportError:  # Windows: no such limit to raise (raise_open_file_limit)
    resource = None
try:  # POSIX: the kernel's unsent bytes of a socket
    import fcntl
    import termios
except ImportError:  # Windows: what a reply waits on is asyncio's buffer alone (CountingTransport.waiting)
    fcntl = termios = None

OPEN_PATHS = ("/", "/health")  # the UI's page (it holds no model access: it asks for the key) and monitoring
LOOPBACK = ("127.0.0.1", "localhost", "::1")
CLIENT_SCOPE_KEY = "nanochat.client"  # set by RequireKey: the key a request gave


# -----------------------------------------------------------------------------
# Keys, and who a request comes from


def client_of(request):
    """Who a request comes from (workers.CLIENT_SHARE): its key where the server has keys, one client whatever its
    addresses (a key's holders cannot be told apart: one of them could use as many addresses as it likes); without
    keys its address, an IPv6 one by its /64, what one host is usually given (the peer's, or behind --trusted-proxy
    the one the proxy forwards: uvicorn puts it in the scope)."""
    if request.scope.get(CLIENT_SCOPE_KEY):
        return request.scope[CLIENT_SCOPE_KEY]
    host = (request.scope.get("client") or ("",))[0]
    try:
        address = ipaddress.ip_address(host)
    except ValueError:  # a Unix socket's path, or no address at all
        return host
    if address.version == 6 and address.ipv4_mapped:
        return str(address.ipv4_mapped)
    if address.version == 6 and not address.is_loopback:
        return str(ipaddress.ip_network(f"{address}/64", strict=False))
    return str(address)


class RequireKey:
    """ASGI wrapper: every request but OPEN_PATHS needs `Authorization: Bearer KEY` with one of the keys (a 401, and a
    400 for two such headers); the key names the client (client_of). Plain ASGI: an HTTP
    middleware would buffer the streams and hide a client's disconnect from them."""

    def __init__(self, app, keys):
        self.app, self.keys = app, [key.encode() for key in keys]

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            headers = [value for name, value in scope["headers"] if name == b"authorization"]
            if len(headers) > 1:
                response = error_response(400, f"{len(headers)} Authorization headers: send one")
                return await response(scope, receive, send)
            header = headers[0] if headers else b""
            scheme, _, given = header.partition(b" ")
            # every key compared, whatever matched: the time taken says nothing of which key came close
            matches = [hmac.compare_digest(given.strip(), key) for key in self.keys]
            if scheme.lower() != b"bearer" or not any(matches):
                reason = "missing" if not header else "wrong"
                response = error_response(401, f"{reason} API key: send the header `Authorization: Bearer <key>` "
                                          "with a key the server was started with (--api-key)", code="invalid_api_key",
                                          headers={"WWW-Authenticate": "Bearer"})
                return await response(scope, receive, send)
            scope[CLIENT_SCOPE_KEY] = f"key {matches.index(True) + 1}"
        return await self.app(scope, receive, send)


# -----------------------------------------------------------------------------
# Connections and open files

HEADER_TIMEOUT = 10.0  # seconds a new connection has to send a whole request's headers
WRITE_TIMEOUT = 30.0  # seconds a reply may go without its client taking STALL_BYTES before the connection is closed
# A reply "moves" while its client takes this many bytes per window (--write-timeout, or EVICT_WINDOW when a new
# connection needs its slot), counted as its TCP acknowledges them (docs/serving.md, "Under hostile load")
STALL_BYTES = 16384
EVICT_WINDOW = 5.0
# A connection that has waited less than this for its request keeps its slot while a newcomer can be let in past the
# bound instead: a client sends its request within a round trip of connecting
NEWCOMER_GRACE = 1.0
OVER_BOUND_SCOPE_KEY = "nanochat.over_bound"  # set on a request that came in past --max-connections


def bind_socket(host, port):
    """Bound before the model loads, so a busy port is reported at once; a forked worker closes its copy, or a server
    that died would leave its port held until every worker noticed."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError as e:
        raise UserError(f"cannot listen on {host}:{port} ({e.strerror or e}); pick another --port or --host") from None
    if hasattr(os, "register_at_fork"):  # Windows spawns its workers: nothing is copied into them
        os.register_at_fork(after_in_child=sock.close)
    return sock


# What raise_open_file_limit says where the system has no per-process limit to raise (Windows' sockets are handles,
# bounded by memory): as many files as the 4,096 connections default_max_connections then allows need
UNLIMITED_OPEN_FILES = 8192


def raise_open_file_limit():
    """The open-file limit raised to the hard limit (each connection is a file); returns the new soft limit."""
    if resource is None:
        return UNLIMITED_OPEN_FILES
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard if hard != resource.RLIM_INFINITY else 1 << 20, hard))
        except (ValueError, OSError):
            pass
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def default_max_connections(open_files):
    """Connections kept open at once: half the open-file limit, at least 256 files, is kept for the model's files, the
    pipes, those let in past the bound and the backlog asyncio accepts before the guard sees it."""
    return max(16, min(4096, open_files - max(256, open_files // 2)))


class CountingTransport:
    """A connection's transport that counts what was written to it: less waiting(), what the client has taken."""

    def __init__(self, transport):
        self.transport, self.written = transport, 0

    def write(self, data):
        self.written += len(data)
        self.transport.write(data)

    def waiting(self):
        """Bytes written that the client has not taken: in asyncio's buffer, or unacknowledged in the kernel's (Linux's
        SIOCOUTQ, where the system says)."""
        unsent, sock = 0, self.transport.get_extra_info("socket")
        if sock is not None and hasattr(termios, "TIOCOUTQ"):  # None (Windows) has no TIOCOUTQ either
            try:
                unsent = struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0" * 4))[0]
            except OSError:
                pass
        return self.transport.get_write_buffer_size() + unsent

    def __getattr__(self, name):  # everything else is the transport's own
        return getattr(self.transport, name)


class ConnectionGuard:
    """
    The open connections, at most max_connections: header_timeout seconds to send a whole request; then judged by what
    the client takes of its reply (fewer than STALL_BYTES in write_timeout seconds: closed). When all are open, a new
    one closes the longest idle, unless that one is new itself (a burst's connections have not sent their requests
    yet: each closed the one before it), else the longest stalled; if every reply moves it is let in past the bound to
    be answered once (AnswerOverBound). docs/serving.md, "Under hostile load", has the story.
    """

    def __init__(self, max_connections, header_timeout=HEADER_TIMEOUT, write_timeout=WRITE_TIMEOUT):
        self.max_connections, self.header_timeout, self.write_timeout = max_connections, header_timeout, write_timeout
        # let in past the bound, each answered once and closed: a burst of new connections as large as this is answered
        # while every slot is busy
        self.max_over_bound = max(64, max_connections // 8)
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
        """Its response is complete and none of it waits in asyncio's buffer (the kernel sends the rest anyway)."""
        cycle = protocol.cycle
        return cycle is not None and cycle.response_complete and not protocol.transport.get_write_buffer_size()

    def opened(self, protocol):
        """A new connection: in a free slot; else in the slot of one idle for NEWCOMER_GRACE, or of the longest
        stalled reply; else let in past the bound; else (a flood) in the slot of the longest idle, however new."""
        if len(self.idle) + len(self.busy) - len(self.over_bound) >= self.max_connections:
            if (idle := self.longest_idle(NEWCOMER_GRACE)) is not None:  # closed at once: its file is what we need
                self.closed_idle += 1
                self.close(idle)
            elif (stalled := self.longest_stalled()) is not None:
                self.closed_stalled += 1
                self.close(stalled)
            elif len(self.over_bound) < self.max_over_bound:
                self.over_bound.add(protocol)
                self.let_in_over_bound += 1
            elif (idle := self.longest_idle(0.0)) is not None:
                self.closed_idle += 1
                self.close(idle)
            else:  # as many let in past the bound as it allows, each with its request in: no file to spare
                self.close(protocol)
                return
        self.wait_for_request(protocol)

    def longest_idle(self, seconds):
        """The connection in a slot that has waited longest for a request, if at least `seconds`; else None. (One let in
        past the bound has no slot to give: it is answered once and closed.)"""
        now = time.monotonic()
        for protocol, since in self.idle.items():  # oldest first
            if protocol not in self.over_bound:
                return protocol if now - since >= seconds else None
        return None

    def stats(self):
        """For /stats: connections open, busy and stalled, and how many were closed or let in past the bound."""
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
        """The whole response written: the connection waits for a request once its last bytes left asyncio's buffer."""
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
        """Moves the mark of each busy connection with nothing waiting or STALL_BYTES taken since; returns now."""
        now = time.monotonic()
        for protocol, (since, taken) in list(self.moved.items()):
            waiting = protocol.transport.waiting()
            taken_now = protocol.transport.written - waiting
            if not waiting or taken_now - taken >= STALL_BYTES:
                self.moved[protocol] = (now, taken_now)
        return now

    def tick(self, loop):
        """Every second while connections are busy: a delivered one waits for its next request, a stalled one past
        write_timeout is closed (the app then cancels its generation)."""
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
    """ASGI wrapper for a connection let in past --max-connections: /health answered, anything else a 503 with
    Retry-After, and the connection closed: the client is told to come back, not cut off."""

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
        response = error_response(503, "every connection this server keeps open (--max-connections) holds a request "
                                  "in progress; try again shortly", "server_busy", headers={"Retry-After": "1"})
        return await response(scope, receive, send_and_close)


# -----------------------------------------------------------------------------
# What a browser's page cannot send


def local_addresses():
    """This machine's addresses, without asking the network: its host name's, and on Linux every interface's."""
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
    """The names a Host header may give for a server bound to `host`: loopback, the bound address, off loopback this
    machine's names and addresses, plus `extra` (--allowed-hosts); a page that rebinds its name still sends it."""
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
    """ASGI wrapper against a web page the user visits: a POST's body must be JSON (a page cannot send that across
    origins unasked; 415) and the Host header must name this server (allowed_hosts, None for any; 421)."""

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
                                    f"{', '.join(sorted(self.allowed))} (a web page may not reach it under another "
                                    "name; chat_web --allowed-hosts adds names)")
            if problem is None and scope["method"] == "POST":
                kind = headers.get(b"content-type", b"").split(b";")[0].strip().lower()
                if kind != b"application/json":
                    problem = (415, f"the body must be JSON, sent with Content-Type: application/json (got "
                                    f"{kind.decode('latin-1') or 'none'!r})")
            if problem:
                return await error_response(*problem)(scope, receive, send)
        return await self.app(scope, receive, send)
