"""
What keeps chat_web serving under hostile load: a bound on open connections that a flood of idle sockets cannot fill
(the connections that have sent no request yet are closed after a few seconds, and the longest-idle one makes room
for a new one when the bound is reached), a file-descriptor limit raised to what the system allows, and checks on
every request that a web page in the user's browser cannot pass: a JSON body, and a Host header naming this server
(without a key on any address, with one on loopback), which DNS rebinding cannot fake.
"""

import ipaddress
import resource
import socket
import time
from collections import OrderedDict

from fastapi.responses import JSONResponse
from uvicorn.protocols.http.h11_impl import H11Protocol

from nanochat.common import print0
from nanochat.serving.openai_api import openai_error

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
