"""Starting a server under test: a free loopback port, and waiting until its /health answers."""

from __future__ import annotations

import socket
import subprocess
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_health(proc: subprocess.Popen, url: str, seconds: float = 90) -> None:
    """Return once `url`/health answers 200; fail with the server's stderr if it exits first or takes longer."""
    deadline = time.monotonic() + seconds
    while True:
        assert proc.poll() is None, f"server exited early: {proc.communicate()[1][-3000:]}"
        assert time.monotonic() < deadline, f"server did not answer /health within {seconds:.0f} s"
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            time.sleep(0.2)
