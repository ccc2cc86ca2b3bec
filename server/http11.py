"""HTTP/1.1 on the standard library's http.server, for an API whose every answer is JSON or a stream: request
bodies (Content-Length or chunked), answers, server-sent events, the client-gone check, CORS, and every refusal,
http.server's own included, in OpenAI's error JSON. The routes are a subclass's (serve.py)."""

from __future__ import annotations

import json
import re
import socket
import sys
import threading
import time
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

from server.errors import ApiError


class HTTPServer(ThreadingHTTPServer):
    """A thread per connection. `app` holds the settings handlers read: timeout (seconds per socket operation),
    max_body (bytes), allowed_origins, log (the access log's file, or None)."""

    request_queue_size = 1024  # the default backlog of 5 resets clients that connect all at once
    block_on_close = False  # stopping must not wait for idle keep-alive connections

    def __init__(self, address: tuple[str, int], handler: type, app):
        self.address_family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET  # ::1 and the like
        self.app = app
        # Connections answering a request or about to, from their accept on (idle keep-alive ones are not):
        # a stop waits for these, as a connection not yet parsed holds a request too.
        self.handling = 0
        self.handling_changed = threading.Condition()
        super().__init__(address, handler)

    def busy(self, n: int) -> None:
        with self.handling_changed:
            self.handling += n
            self.handling_changed.notify_all()

    def process_request(self, request, client_address) -> None:
        self.busy(1)  # before its thread starts; shutdown_request, the thread's last act, takes it back
        super().process_request(request, client_address)

    def shutdown_request(self, request) -> None:
        super().shutdown_request(request)
        self.busy(-1)

    def handle_error(self, request, client_address) -> None:
        if not isinstance(sys.exc_info()[1], ConnectionError):  # a client gone mid-request is routine: no traceback
            super().handle_error(request, client_address)


class RequestHandler(BaseHTTPRequestHandler):
    """Reads a request, hands it to `route`, and answers an ApiError it raises in OpenAI's JSON."""

    protocol_version = "HTTP/1.1"  # keep-alive, which the openai client uses; streams go chunked
    default_request_version = "HTTP/1.1"  # a request line without a version still gets a status line
    server_version = "laneserve"
    server: HTTPServer

    def setup(self) -> None:
        # Headers and body leave in separate writes; with Nagle's algorithm on, a keep-alive client's
        # delayed ACK would hold the second one back.
        self.request.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.app = self.server.app
        self.timeout = self.app.timeout
        self.checked = 0.0  # when _client_closed last looked at the socket
        self.served = False  # a request was read on this connection
        super().setup()

    def route(self, method: str, path: str, body: bytes) -> None:
        raise NotImplementedError

    def log_message(self, format: str, *args) -> None:
        pass  # clients' protocol errors get their answer and idle keep-alive timeouts are routine: no log

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """http.server's own refusals (bad request line, unknown method, oversized headers) as OpenAI JSON, not HTML."""
        self.close_connection = True
        self._send(code, ApiError(code, message or HTTPStatus(code).phrase).body())

    def parse_request(self) -> bool:
        if not super().parse_request():
            return False
        if self.headers.defects:  # a line with no colon ends email's parse: the headers after it would be dropped
            self.send_error(400, "malformed header line (no colon)")
            return False
        return True

    def handle_expect_100(self) -> bool:
        """100 Continue only for a body the server would read: an oversized one gets its 413 before it is sent."""
        if (n := self.headers.get("Content-Length", "")).isdecimal() and int(n) > self.app.max_body:
            self.send_error(413, f"the request body is over {self.app.max_body} bytes")
            return False
        return super().handle_expect_100()

    def end_headers(self) -> None:
        # CORS: a page of an allowed origin may read our answers. (No headers yet: a refused request line.)
        if origin := self._origin():
            self.send_header("Access-Control-Allow-Origin", origin)
            self.send_header("Vary", "Origin")
        super().end_headers()

    def _origin(self) -> str | None:
        origin, allowed = getattr(self, "headers", None) and self.headers.get("Origin"), self.app.allowed_origins
        return origin if origin and ("*" in allowed or origin in allowed) else None

    def handle_one_request(self) -> None:
        if self.served:  # keep-alive: idle, so not counted, until the next request's first byte
            self.server.busy(-1)
            try:
                self.rfile.peek(1)
            except OSError:  # the idle timeout, or a reset
                self.close_connection = True
                return
            finally:
                self.server.busy(1)
        self.served = True
        super().handle_one_request()

    def do_GET(self) -> None:
        self._answer()

    do_POST = do_HEAD = do_PUT = do_PATCH = do_DELETE = do_OPTIONS = do_GET

    def _answer(self) -> None:
        began, self.status, self.log_info = time.monotonic(), 0, {}
        if self.command == "OPTIONS" and self._origin() and self.headers.get("Access-Control-Request-Method"):
            # A browser's CORS preflight (it carries no API key): which methods and headers the request may use.
            self._head(
                204,
                [
                    ("Access-Control-Allow-Methods", "GET, POST"),
                    ("Access-Control-Max-Age", "600"),
                    ("Access-Control-Allow-Headers", self.headers.get("Access-Control-Request-Headers", "")),
                    ("Content-Length", "0"),
                ],
            )
            return
        method = "GET" if self.command == "HEAD" else self.command  # HEAD: GET's headers, no body
        if method != "POST" and (
            method != "GET"
            or "Transfer-Encoding" in self.headers
            or self.headers.get("Content-Length", "0").strip() != "0"
        ):
            self.close_connection = True  # a body it may carry stays unread: it must not pass for the next request
        try:
            try:
                body = self._read_body() if method == "POST" else b""
            except ApiError:
                self.close_connection = True  # the body's unread rest would be taken for the next request
                raise
            try:
                path = urlsplit(self.path).path
            except ValueError:  # such as http://[/health
                raise ApiError(400, f"malformed request target {self.path[:200]!r}") from None
            self.route(method, path, body)
        except ApiError as e:
            self._send(e.status, e.body(), headers=e.headers)
        except OSError:  # the client left mid-response
            self.close_connection = True
            self.log_info["client"] = "gone"
        if self.app.log:
            info = "".join(f" {k}={v:.3f}s" if isinstance(v, float) else f" {k}={v}" for k, v in self.log_info.items())
            # No status sent: the client left before its answer began, logged as nginx's 499 "client closed request".
            print(
                f'{self.client_address[0]} "{self.command} {self.path[:200]}" {self.status or 499}{info} '
                f"duration={time.monotonic() - began:.3f}s",
                file=self.app.log,
                flush=True,
            )

    def _read_body(self) -> bytes:
        coding = self.headers.get("Transfer-Encoding")
        chunked = coding is not None and coding.strip().lower() == "chunked" and "Content-Length" not in self.headers
        length = int(n) if (n := self.headers.get("Content-Length", "")).isdecimal() else -1
        if len(set(self.headers.get_all("Content-Length", []))) > 1:  # which one frames the body? (smuggling)
            raise ApiError(400, "conflicting Content-Length headers")
        if not chunked and (not 0 <= length <= self.app.max_body or coding is not None):
            if coding is not None:  # another coding, or both headers (a request-smuggling pattern)
                raise ApiError(
                    501 if "Content-Length" not in self.headers else 400,
                    f"Transfer-Encoding {coding[:50]!r}: only 'chunked', without a Content-Length",
                )
            if length > self.app.max_body:
                # Read and drop a body of up to 8 times the limit first: a client that sends all of its
                # body before reading the answer would find the connection reset instead of the 413.
                while 0 < length <= 8 * self.app.max_body and (chunk := self.rfile.read(min(length, 1 << 20))):
                    length -= len(chunk)
                raise ApiError(413, f"the request body is over {self.app.max_body} bytes")
            raise ApiError(411, "a request body needs a valid Content-Length")
        try:
            body = self._read_chunks() if chunked else self.rfile.read(length)
        except TimeoutError:
            raise ApiError(408, f"timed out after {self.app.timeout:g}s reading the request body") from None
        if len(body) < length:  # the client closed its side before sending all of it
            raise ApiError(400, f"the request body ended after {len(body)} of its {length} bytes")
        return body

    def _read_chunks(self) -> bytes:
        """A chunked body (a streamed upload's, instead of a Content-Length): each chunk its size in hex on a line,
        then its bytes and CRLF; a chunk of size 0 and an empty line (after any trailer lines) end it."""
        body = b""
        while size := self._chunk_size():
            if len(body) + size > self.app.max_body:
                raise ApiError(413, f"the request body is over {self.app.max_body} bytes")
            data = self.rfile.read(size + 2)
            if data[size:] != b"\r\n":
                raise ApiError(400, "a chunk of the request body is cut short or not followed by CRLF")
            body += data[:size]
        while self.rfile.readline(8192).strip():  # trailer fields: read past, unused
            pass
        return body

    def _chunk_size(self) -> int:
        line = self.rfile.readline(1024).split(b";")[0].strip()  # ";name=value": chunk extensions, unused
        if not re.fullmatch(rb"[0-9a-fA-F]{1,8}", line):
            raise ApiError(400, f"malformed chunk size {line[:20]!r} in the request body")
        return int(line, 16)

    def _send(self, status: int, obj: dict | str, content_type: str = "application/json", headers: tuple = ()) -> None:
        data = (obj if isinstance(obj, str) else json.dumps(obj)).encode()
        headers = [("Content-Type", content_type), ("Content-Length", str(len(data))), *headers]
        if status in (408, 500):  # openai's clients retry these twice unless told: it would fail the same way
            headers.append(("x-should-retry", "false"))
        if self.close_connection:
            headers.append(("Connection", "close"))
        elif self.request_version == "HTTP/1.0":  # it asked to keep the connection: HTTP/1.0 closes unless told
            headers.append(("Connection", "keep-alive"))
        self._head(status, headers)
        if self.command != "HEAD":
            self.wfile.write(data)

    def _head(self, status: int, headers: list[tuple[str, str]]) -> None:
        self.status = status  # for the access log
        self.send_response(status)
        for header in headers:
            self.send_header(*header)
        self.end_headers()

    def _open_stream(self) -> None:
        # HTTP/1.0 has no chunked coding: there the stream ends when the connection closes.
        self.chunked = self.request_version == "HTTP/1.1"
        self.close_connection = self.close_connection or not self.chunked
        self._head(
            200,
            [
                ("Content-Type", "text/event-stream"),
                ("Cache-Control", "no-cache"),
                ("Transfer-Encoding", "chunked") if self.chunked else ("Connection", "close"),
            ],
        )

    def _event(self, obj: dict | str) -> None:
        self._chunk(f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n".encode())

    def _chunk(self, data: bytes) -> None:
        """A piece of a stream's body; b"" ends it."""
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n" if self.chunked else data)

    def _client_closed(self) -> bool:
        """Whether the client closed its socket, looked at most every 0.1 s: a syscall per token would take the
        GIL from the engine thread. Readable yet empty means closed (a pipelined request is readable, not empty)."""
        if time.monotonic() - self.checked < 0.1:
            return False
        # A peek that does not wait, rather than select(), which cannot watch a descriptor numbered 1024 or
        # more (a server holding a thousand connections has them).
        self.connection.settimeout(0)
        try:
            closed = not self.connection.recv(1, socket.MSG_PEEK)
        except BlockingIOError:  # nothing to read: the client is there
            closed = False
        finally:
            self.connection.settimeout(self.timeout)
        self.checked = time.monotonic()
        return closed
