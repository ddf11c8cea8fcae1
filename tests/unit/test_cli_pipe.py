"""The command line under a reader that stops early (``cpgbroker status | head -1``): it ends
quietly with 141 (128 + SIGPIPE, what a shell shows for git and coreutils), never a traceback.
The member is a stand-in admin endpoint whose answers print far more than a pipe holds, so the
command is still writing when its reader goes away."""

from __future__ import annotations

import http.server
import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from typing import Any

import pytest

QUEUES = 5000  # ~250 KiB of output: well past a pipe's 64 KiB


class _Member(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body: Any
        if self.path == "/status":
            body = {
                "state": "standalone",
                "event_seq": 7,
                "connections": {"local": 0, "shadow": 0},
                "queues": {
                    f"/:q{i}": {"ready": i, "unacked": 0, "consumers": 0} for i in range(QUEUES)
                },
            }
        else:  # /api/queues/%2F
            body = [{"name": f"q{i}", "messages": i} for i in range(QUEUES)]
        raw = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def member_url() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Member)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.mark.parametrize("command", [["status"], ["ctl", "list_queues"]])
def test_a_reader_that_closes_early_ends_the_command_quietly(
    member_url: str, command: list[str]
) -> None:
    env = {**os.environ, "CPGBROKER_ADMIN_TOKEN": "t"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "cpgbroker", *command, "--url", member_url],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
    )
    assert proc.stdout is not None and proc.stderr is not None
    # As `head -1`: one line, then the reader goes away while the command is still writing.
    first = proc.stdout.readline()
    proc.stdout.close()
    err = proc.stderr.read().decode()
    proc.stderr.close()
    assert proc.wait(timeout=60) == 141, err
    assert first.strip()
    assert err == ""  # no BrokenPipeError traceback, no "Exception ignored" at exit
