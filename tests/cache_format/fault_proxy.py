"""A fault-injecting HTTP proxy in front of the test S3 server (tests only).

Every `every`-th request meets the next fault of `kinds`, in turn; the others pass through:
- "503": a SlowDown answer (S3's throttling), the request never reaches the server;
- "500": an InternalError answer, never reaching the server;
- "drop": the connection closed with no answer at all;
- "stall": the request held `stall_s` seconds, then passed on;
- "truncate": the server's answer with its full Content-Length but half its body, then the
  connection closed (a body cut off in transit);
- "reorder": a listing's entries in reverse order (S3 promises key order; a client must not rely
  on it for anything but paging); every listing that meets no other fault is reordered.
`injected` counts the faults by kind. The proxy runs in a thread of the test process: it is test
scaffolding on the CPU, not GPU work.
"""

from __future__ import annotations

import http.client
import re
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

KINDS = ("503", "500", "drop", "stall", "truncate", "reorder")
_HOP = {"connection", "keep-alive", "transfer-encoding", "proxy-connection"}


class FaultProxy:
    """Forwards to `upstream` (http://host:port) on a free local port; `url` is its own endpoint."""

    def __init__(self, upstream: str, *, every: int = 3, kinds=KINDS, stall_s: float = 1.5) -> None:
        self.upstream, self.every, self.kinds, self.stall_s = urlsplit(upstream), every, tuple(kinds), stall_s
        self.injected: Counter = Counter()
        self.requests = 0
        self.faulty = True
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> FaultProxy:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()

    def next_fault(self, is_listing: bool) -> str | None:
        """The fault this request meets (None: passed through); a listing fault only on listings."""
        with self._lock:
            self.requests += 1
            if not self.faulty:
                return None
            kind = self.kinds[(self.requests // self.every) % len(self.kinds)]
            if self.requests % self.every or (kind == "reorder" and not is_listing):
                kind = "reorder" if is_listing and "reorder" in self.kinds else None
            if kind is None:
                return None
            self.injected[kind] += 1
            return kind

    def forward(self, method: str, path: str, headers: dict, body: bytes):
        conn = http.client.HTTPConnection(self.upstream.hostname, self.upstream.port, timeout=60)
        try:
            conn.request(method, path, body=body, headers=headers)
            r = conn.getresponse()
            return r.status, r.reason, r.getheaders(), r.read()
        finally:
            conn.close()


def _error_xml(code: str, message: str) -> bytes:
    return f"<?xml version='1.0' encoding='UTF-8'?><Error><Code>{code}</Code><Message>{message}</Message></Error>".encode()


def _reordered(body: bytes) -> bytes:
    """A ListObjectsV2 answer with its <Contents> entries reversed."""
    entries = re.findall(rb"<Contents>.*?</Contents>", body, flags=re.S)
    if len(entries) < 2:
        return body
    head, tail = body.split(entries[0], 1)[0], body.rsplit(entries[-1], 1)[1]
    return head + b"".join(reversed(entries)) + tail


def _handler(proxy: FaultProxy):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:  # the test's output stays its own
            pass

        def _answer(self, status: int, reason: str, headers, body: bytes, *, cut: bool = False) -> None:
            self.send_response(status, reason)
            head = self.command == "HEAD"  # its Content-Length is the object's size, and it has no body
            for k, v in headers:
                if k.lower() not in _HOP and (head or k.lower() != "content-length"):
                    self.send_header(k, v)
            if not head:
                self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if not head:
                self.wfile.write(body[: len(body) // 2] if cut else body)
            if cut:
                self.close_connection = True

        def _any(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            is_listing = self.command == "GET" and "list-type=2" in self.path
            kind = proxy.next_fault(is_listing)
            if kind in ("503", "500"):
                code = "SlowDown" if kind == "503" else "InternalError"
                return self._answer(int(kind), code, [("Content-Type", "application/xml")],
                                    _error_xml(code, "injected by the test proxy"))
            if kind == "drop":
                self.close_connection = True
                return None
            if kind == "stall":
                time.sleep(proxy.stall_s)
            headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP}
            status, reason, rheaders, rbody = proxy.forward(self.command, self.path, headers, body)
            if kind == "reorder":
                rbody = _reordered(rbody)
            return self._answer(status, reason, rheaders, rbody, cut=kind == "truncate" and len(rbody) > 1)

        do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _any

    return Handler
