"""A small HTTP/1.1 server for the remote-URL tests: files of a directory served with byte ranges,
ETags and If-Match, and faults on demand. Started by the tests on 127.0.0.1 (never anything else).

Faults (RangeServer.faults, a dict, changed by a test between requests):
  "status_burst": (code, n)   the next n GETs answer `code` (503, 429, 404, 403, ...)
  "reset_after": n            the next GET with a body sends n bytes of it, then closes the connection
  "short": n                  the next GET with a body sends n bytes fewer than its Content-Length says
  "reset_big": (size, n)      the next GET of more than `size` bytes sends n bytes, then closes
  "slow_s": s                 every body write waits s seconds first
  "ignore_range": True        every GET answers 200 with the whole file
"""
from __future__ import annotations

import hashlib
import http.server
import os
import re
import socket
import threading
import time

_RANGE = re.compile(r"bytes=(\d+)-(\d*)$")


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive: connections are reused, as a real server's are

    def log_message(self, *args):  # quiet
        pass

    def _etag(self, path):
        st = os.stat(path)
        return '"' + hashlib.sha1(f"{st.st_ino}-{st.st_size}-{st.st_mtime_ns}".encode()).hexdigest()[:16] + '"'

    def do_GET(self):  # noqa: N802
        server = self.server
        server.requests.append((self.path, self.headers.get("Range")))
        server.headers.append(dict(self.headers))
        faults = server.faults
        burst = faults.get("status_burst")
        if burst and burst[1] > 0:
            faults["status_burst"] = (burst[0], burst[1] - 1)
            body = b"<Error><Code>Busy</Code><Message>try later</Message></Error>"
            self.send_response(burst[0])
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        path = os.path.join(server.root, self.path.split("?")[0].lstrip("/"))
        if not os.path.isfile(path):
            self.send_response(404)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        size = os.path.getsize(path)
        etag = self._etag(path)
        match = self.headers.get("If-Match")
        if match is not None and match != etag:
            self.send_response(412)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        rng = self.headers.get("Range")
        m = _RANGE.match(rng) if rng and not faults.get("ignore_range") else None
        if m:
            start = int(m.group(1))
            end = min(int(m.group(2)) if m.group(2) else size - 1, size - 1)
            if start >= size:
                self.send_response(416)
                self.send_header("Content-Range", f"bytes */{size}")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {start}-{end}/{size}")
        else:
            start, end = 0, size - 1
            self.send_response(200)
        length = end - start + 1
        self.send_header("Content-Length", str(length))
        self.send_header("ETag", etag)
        self.end_headers()
        with open(path, "rb") as f:
            f.seek(start)
            data = f.read(length)
        if faults.get("slow_s"):
            time.sleep(faults["slow_s"])
        big = faults.get("reset_big")
        if big is not None and length > big[0]:
            faults["reset_after"] = faults.pop("reset_big")[1]
        if faults.get("reset_after") is not None:
            n = faults.pop("reset_after")
            self.wfile.write(data[:n])
            self.wfile.flush()
            self.connection.shutdown(socket.SHUT_RDWR)
            self.close_connection = True
            return
        if faults.get("short") is not None:
            data = data[:max(0, len(data) - faults.pop("short"))]
            self.wfile.write(data)
            self.wfile.flush()
            self.connection.shutdown(socket.SHUT_RDWR)
            self.close_connection = True
            return
        self.wfile.write(data)


class RangeServer(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, root):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.root = str(root)
        self.faults = {}
        self.requests = []  # (path, Range header) of every GET
        self.headers = []   # every GET's headers
        self._thread = threading.Thread(target=self.serve_forever, daemon=True)
        self._thread.start()

    def url(self, name=""):
        return f"http://127.0.0.1:{self.server_address[1]}/{name}"

    def stop(self):
        self.shutdown()
        self.server_close()
