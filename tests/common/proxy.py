"""A forwarding proxy in front of the S3 test server (tests/common/proxy.rs), from
Python's standard library only.

    proxy.py UPSTREAM_PORT LOG [--tls CERT KEY] [--fail-rate R] [--max-run N] [--seed S]

Listens on a free loopback port, which it prints as `listening PORT` once it accepts,
and forwards every request to 127.0.0.1:UPSTREAM_PORT with its method, path and headers
as received: the Host header is the proxy's, which is what the client signed, so SigV4
still verifies upstream. With --tls it terminates TLS with CERT and KEY (the handshake
runs in the connection's thread, so a client that refuses the certificate stalls no
one). With --fail-rate it answers that share of GETs with S3's `503 SlowDown` instead,
never more than --max-run times in a row for one (path, Range): a client that retries
gets through. Each request is one line in LOG: `503 METHOD PATH RANGE`, `fwd METHOD PATH
RANGE STATUS`, `tls-fail REASON`, `upstream-fail REASON`.
"""

import argparse
import http.client
import http.server
import random
import ssl
import sys
import threading

HOP = {"connection", "keep-alive", "proxy-connection", "te", "trailer", "transfer-encoding",
       "upgrade", "content-length"}

SLOWDOWN = (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
            b"<Message>Please reduce your request rate.</Message>"
            b"<RequestId>archfs-test-proxy</RequestId></Error>")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("upstream", type=int)
    p.add_argument("log")
    p.add_argument("--tls", nargs=2, metavar=("CERT", "KEY"))
    p.add_argument("--fail-rate", type=float, default=0.0)
    p.add_argument("--max-run", type=int, default=2)
    p.add_argument("--seed", type=int, default=1)
    a = p.parse_args()

    lock = threading.Lock()
    log = open(a.log, "a", buffering=1)
    rng = random.Random(a.seed)
    refused = {}  # (path, range) -> 503s sent in a row
    ctx = None
    if a.tls:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(a.tls[0], a.tls[1])

    def note(line):
        with lock:
            log.write(line + "\n")

    def refuse(method, path, rng_header):
        if method != "GET" or a.fail_rate <= 0:
            return False
        key = (path, rng_header)
        with lock:
            n = refused.get(key, 0)
            if n < a.max_run and rng.random() < a.fail_rate:
                refused[key] = n + 1
                return True
            refused.pop(key, None)
            return False

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        upstream = None

        def setup(self):
            if ctx is not None:
                try:
                    self.request = ctx.wrap_socket(self.request, server_side=True)
                except (ssl.SSLError, OSError) as e:
                    note(f"tls-fail {e!r}")
                    raise
            super().setup()

        def log_message(self, *args):
            pass

        def proxy(self):
            method, path = self.command, self.path
            rng_header = self.headers.get("Range", "-")
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length) if length else None
            if refuse(method, path, rng_header):
                note(f"503 {method} {path} {rng_header}")
                self.send_response_only(503, "Slow Down")
                self.send_header("Content-Type", "application/xml")
                self.send_header("Content-Length", str(len(SLOWDOWN)))
                self.end_headers()
                self.wfile.write(SLOWDOWN)
                return
            for attempt in (1, 2):
                try:
                    if self.upstream is None:
                        self.upstream = http.client.HTTPConnection("127.0.0.1", a.upstream,
                                                                   timeout=120)
                    c = self.upstream
                    c.putrequest(method, path, skip_host=True, skip_accept_encoding=True)
                    for k, v in self.headers.items():
                        if k.lower() not in HOP:
                            c.putheader(k, v)
                    if body is not None:
                        c.putheader("Content-Length", str(len(body)))
                    c.endheaders(body)
                    resp = c.getresponse()
                    data = resp.read()
                    break
                except (http.client.HTTPException, OSError) as e:
                    # A kept-alive upstream connection closed under us: once more, fresh.
                    if self.upstream is not None:
                        self.upstream.close()
                    self.upstream = None
                    if attempt == 2:
                        note(f"upstream-fail {e!r}")
                        self.send_error(502)
                        return
            note(f"fwd {method} {path} {rng_header} {resp.status}")
            self.send_response_only(resp.status, resp.reason)
            for k, v in resp.getheaders():
                if k.lower() not in HOP:
                    self.send_header(k, v)
            if method == "HEAD":
                self.send_header("Content-Length", resp.getheader("Content-Length", "0"))
            else:
                self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if method != "HEAD":
                self.wfile.write(data)

        do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = proxy

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    print(f"listening {server.server_address[1]}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    sys.exit(main())
