"""A small HTTP/1.1 server for the remote-URL tests: files of a directory served with byte ranges,
ETags and If-Match, and faults on demand. Started by the tests on 127.0.0.1 (never anything else).

Faults (RangeServer.faults, a dict, changed by a test between requests):
  "status_burst": (code, n)   the next n GETs answer `code` (503, 429, 404, 403, ...)
  "reset_after": n            the next GET with a body sends n bytes of it, then closes the connection
  "short": n                  the next GET with a body sends n bytes fewer than its Content-Length says
  "reset_big": (size, n)      the next GET of more than `size` bytes sends n bytes, then closes
  "slow_s": s                 every body write waits s seconds first
  "ignore_range": True        every GET answers 200 with the whole file
  "huge_200": n               every GET answers 200 with a body of n zero bytes, streamed until the
                              client hangs up (RangeServer.sent counts what went out)
  "range_from_start": True    every 206 carries the object's first bytes, labelled as such
  "range_shift": n            every 206 carries the range n bytes later, labelled as such
  "total": n                  every 206's Content-Range claims an object of n bytes (bytes as asked)
  "no_etag": True             no ETag header (Last-Modified only, unless "no_last_modified" too)
  "no_last_modified": True    no Last-Modified header
  "weak_etag": True           the ETag is weak (W/"..."), which If-Match never matches
  "error_body": n             a "status_burst" answer's body goes on for n zero bytes after the XML
  "retry_after": s            a "status_burst" answer carries Retry-After: s
  "location": url             a "status_burst" answer carries Location: url (a redirect)
  "trickle": (n, s)           every body is sent n bytes at a time, s seconds apart
  "short_206": n              the next 206 of more than n bytes announces and sends n bytes fewer
                              than its range, and ends cleanly (a flaky proxy: not a broken connection)
  "gzip_206": n               the next 206 of more than n bytes sends its range gzip-compressed
                              (Content-Encoding: gzip)
Every answer carries a Last-Modified of the file's mtime unless told otherwise.
"""
from __future__ import annotations

import email.utils
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
        server.times.append(time.monotonic())
        server.headers.append(dict(self.headers))
        faults = server.faults
        burst = faults.get("status_burst")
        if burst and burst[1] > 0:
            faults["status_burst"] = (burst[0], burst[1] - 1)
            body = b"<Error><Code>Busy</Code><Message>try later</Message></Error>"
            self.send_response(burst[0])
            huge = faults.get("error_body", 0)
            if faults.get("location") is not None:
                self.send_header("Location", faults["location"])
            if faults.get("retry_after") is not None:
                self.send_header("Retry-After", str(faults["retry_after"]))
            self.send_header("Content-Length", str(len(body) + huge))
            self.end_headers()
            self.wfile.write(body)
            if huge:
                self._stream_zeros(huge)
            return
        path = os.path.join(server.root, self.path.split("?")[0].lstrip("/"))
        if not os.path.isfile(path):
            self.send_response(404)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        size = os.path.getsize(path)
        etag = ("W/" if faults.get("weak_etag") else "") + self._etag(path)
        last_modified = email.utils.formatdate(os.stat(path).st_mtime, usegmt=True)
        if faults.get("huge_200"):
            self._huge(faults["huge_200"])
            return
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
            if faults.get("range_from_start"):
                start, end = 0, end - start
            elif faults.get("range_shift"):
                start, end = start + faults["range_shift"], min(end + faults["range_shift"], size - 1)
            self.send_header("Content-Range", f"bytes {start}-{end}/{faults.get('total', size)}")
        else:
            start, end = 0, size - 1
            self.send_response(200)
        length = end - start + 1
        with open(path, "rb") as f:
            f.seek(start)
            data = f.read(length)
        if m and faults.get("short_206") is not None and len(data) > faults["short_206"]:
            data = data[:len(data) - faults.pop("short_206")]
            length = len(data)
        if m and faults.get("gzip_206") is not None and len(data) > faults["gzip_206"]:
            del faults["gzip_206"]
            import gzip
            data = gzip.compress(data)
            length = len(data)
            self.send_header("Content-Encoding", "gzip")
        self.send_header("Content-Length", str(length))
        if not faults.get("no_etag"):
            self.send_header("ETag", etag)
        if not faults.get("no_last_modified"):
            self.send_header("Last-Modified", last_modified)
        self.end_headers()
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
        if faults.get("trickle"):
            n, pause = faults["trickle"]
            try:
                for i in range(0, len(data), n):
                    self.wfile.write(data[i:i + n])
                    self.wfile.flush()
                    time.sleep(pause)
            except (BrokenPipeError, ConnectionResetError):
                self.close_connection = True
            return
        self.wfile.write(data)

    def _huge(self, n):
        self.send_response(200)
        self.send_header("Content-Length", str(n))
        self.end_headers()
        self._stream_zeros(n)

    def _stream_zeros(self, n):
        self.server.sent = 0
        chunk = bytes(1 << 20)
        try:
            while self.server.sent < n:
                self.wfile.write(chunk[:min(len(chunk), n - self.server.sent)])
                self.server.sent += min(len(chunk), n - self.server.sent)
        except (BrokenPipeError, ConnectionResetError):
            pass
        self.close_connection = True


class RangeServer(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, root):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.root = str(root)
        self.faults = {}
        self.requests = []  # (path, Range header) of every GET
        self.times = []  # when each came (time.monotonic())
        self.headers = []   # every GET's headers
        self.sent = 0       # body bytes of "huge_200" answers sent
        self._thread = threading.Thread(target=self.serve_forever, daemon=True)
        self._thread.start()

    def url(self, name=""):
        return f"http://127.0.0.1:{self.server_address[1]}/{name}"

    def stop(self):
        self.shutdown()
        self.server_close()
