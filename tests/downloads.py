"""A real HTTP server on loopback for download tests (with Range support, so resuming is real), and running a
download job to its end."""

from __future__ import annotations

import re
import subprocess
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from django.urls import reverse

from jobs import runner
from jobs.models import Job
from modelfiles.download import curl_config


class RangeServer:
    """A small HTTP/1.1 file server: HEAD and GET, `Range: bytes=N-[M]` (206, or 416 past the end) unless
    `ranges` is off, optional pacing (`chunk` bytes every `pause` seconds), and a dropped connection on
    demand (`drop_after`). It records every request."""

    def __init__(
        self, files: dict[str, bytes], *, host: str = "127.0.0.1", ranges: bool = True, pause: float = 0.0
    ) -> None:
        self.files, self.ranges, self.pause, self.chunk = files, ranges, pause, 256 * 1024
        # When set, the next GET sends only this many bytes of its body and drops the connection.
        self.drop_after: int | None = None
        self.requests: list[tuple[str, str, str | None]] = []
        self.server = ThreadingHTTPServer((host, 0), self._handler())
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def url(self, path: str) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{host}:{port}{path}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def _handler(self):
        owner = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def do_HEAD(self) -> None:
                self._serve(body=False)

            def do_GET(self) -> None:
                self._serve(body=True)

            def _serve(self, *, body: bool) -> None:
                owner.requests.append((self.command, self.path, self.headers.get("Range")))
                data = owner.files.get(self.path.split("?", 1)[0])
                if data is None:
                    return self._empty(404)
                start, end, status = 0, len(data) - 1, 200
                wanted = re.fullmatch(r"bytes=(\d+)-(\d*)", self.headers.get("Range") or "")
                if wanted and owner.ranges:
                    start = int(wanted[1])
                    if start >= len(data):
                        return self._empty(416, {"Content-Range": f"bytes */{len(data)}"})
                    end, status = min(int(wanted[2]) if wanted[2] else end, end), 206
                self.send_response(status)
                self.send_header("Content-Length", str(end - start + 1))
                if owner.ranges:
                    self.send_header("Accept-Ranges", "bytes")
                if status == 206:
                    self.send_header("Content-Range", f"bytes {start}-{end}/{len(data)}")
                self.end_headers()
                if body:
                    self._send_body(data[start : end + 1])

            def _send_body(self, payload: bytes) -> None:
                if owner.drop_after is not None and len(payload) > owner.drop_after:
                    payload, owner.drop_after = payload[: owner.drop_after], None
                    self.wfile.write(payload)
                    self.wfile.flush()
                    self.close_connection = True
                    return
                if not owner.pause:
                    self.wfile.write(payload)
                    return
                for offset in range(0, len(payload), owner.chunk):
                    self.wfile.write(payload[offset : offset + owner.chunk])
                    self.wfile.flush()
                    time.sleep(owner.pause)

            def _empty(self, status: int, headers: dict[str, str] | None = None) -> None:
                self.send_response(status)
                for key, value in (headers or {}).items():
                    self.send_header(key, value)
                self.send_header("Content-Length", "0")
                self.end_headers()

        return Handler


def download(node, url: str, dest: Path | str, *, sha256: str = "", name: str = "tiny", **extra) -> Job:
    params = {"url": url, "dest": str(dest), "sha256": sha256, "name": name, **extra}
    return Job.objects.create(kind="download", node=node, title=f"Download {name}", params=params)


def run(job: Job) -> Job:
    runner.run_job(job.pk)
    job.refresh_from_db()
    return job


def log_text(job: Job) -> str:
    return "\n".join(job.log_lines.order_by("seq").values_list("text", flat=True))


def post_download(client, **fields):
    data = {f"download-{key}": value for key, value in fields.items()}
    return client.post(reverse("modelfiles:download"), data)


def curl_reads_back(url: str) -> str:
    """The URL real curl takes from `curl_config(url)` on its standard input (with `--globoff`, as the
    download's curl). It connects to 127.0.0.1:9 whatever the URL says (nothing listens there), so nothing
    leaves this machine."""
    result = subprocess.run(
        ["curl", "-sS", "--globoff", "--noproxy", "*", "--connect-to", "::127.0.0.1:9", "--max-time", "5",
         "--output", "/dev/null", "--write-out", "%{url}", "--config", "-"],
        input=curl_config(url), capture_output=True, timeout=30,
    )  # fmt: skip
    return result.stdout.decode()
