"""Headless Chromium driven over the Chrome DevTools protocol (websockets, already installed with Prefect).

No driver binary to keep in step with the browser: one websocket to the page, three calls (navigate, evaluate,
screenshot). The browser runs in its own process group with a fresh profile and every background service off,
so that on a closed network it neither phones home nor waits for it.
"""

from __future__ import annotations

import base64
import itertools
import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx
from websockets.sync.client import connect

CHROMIUM = Path("/usr/bin/chromium")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-dev-shm-usage", "--hide-scrollbars", "--remote-debugging-address=127.0.0.1",
         "--remote-debugging-port=0"]


class BrowserError(RuntimeError):
    """The browser did not start, or a DevTools call failed."""


class Browser:
    """One headless Chromium page; `close()` kills the browser's whole process group."""

    # Tall: the Prefect UI scrolls inside its own panel, so a screenshot holds what the window shows.
    def __init__(self, profile: Path, width: int = 1400, height: int = 3000, timeout: float = 60) -> None:
        profile.mkdir(parents=True, exist_ok=True)
        (profile / "DevToolsActivePort").unlink(missing_ok=True)  # a stale port from an earlier browser
        self.log = open(profile.parent / "chromium.log", "w")
        self.proc = subprocess.Popen([str(CHROMIUM), *FLAGS, f"--user-data-dir={profile}",
                                      f"--window-size={width},{height}", "about:blank"],
                                     stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        self.ids = itertools.count(1)
        try:
            port = self._devtools_port(profile / "DevToolsActivePort", timeout)
            pages = httpx.get(f"http://127.0.0.1:{port}/json/list", timeout=10).json()
            url = next(p["webSocketDebuggerUrl"] for p in pages if p["type"] == "page")
            self.ws = connect(url, max_size=64 * 2**20, open_timeout=timeout)
        except Exception:
            self.close()
            raise

    def _devtools_port(self, active: Path, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise BrowserError(f"chromium exited with {self.proc.returncode}; see {self.log.name}")
            if active.exists() and active.read_text().strip():
                return int(active.read_text().split()[0])
            time.sleep(0.2)
        raise BrowserError(f"chromium wrote no DevTools port within {timeout:.0f} s; see {self.log.name}")

    def call(self, method: str, timeout: float = 60, **params: Any) -> dict[str, Any]:
        """Send one DevTools command and return its result (events arriving meanwhile are skipped)."""
        call_id = next(self.ids)
        self.ws.send(json.dumps({"id": call_id, "method": method, "params": params}))
        deadline = time.monotonic() + timeout
        while True:
            message = json.loads(self.ws.recv(timeout=max(0.1, deadline - time.monotonic())))
            if message.get("id") == call_id:
                if "error" in message:
                    raise BrowserError(f"{method}: {message['error']}")
                return message["result"]

    def goto(self, url: str) -> None:
        """Open a URL in the page."""
        self.call("Page.navigate", url=url)

    def evaluate(self, expression: str) -> Any:
        """The value of a JavaScript expression in the page (awaited when it is a promise)."""
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            raise BrowserError(f"{expression[:80]}...: {result['exceptionDetails'].get('text')}")
        return result["result"].get("value")

    def wait_for(self, expression: str, timeout: float = 60, every: float = 0.5) -> Any:
        """Poll a JavaScript expression until it is truthy (a single-page app renders after it loads)."""
        deadline = time.monotonic() + timeout
        while True:
            value = self.evaluate(expression)
            if value or time.monotonic() > deadline:
                return value
            time.sleep(every)

    def screenshot(self, path: Path) -> Path:
        """A PNG of the window at `path`."""
        path.write_bytes(base64.b64decode(self.call("Page.captureScreenshot", format="png")["data"]))
        return path

    def close(self) -> None:
        """Close the socket and kill the browser's process group."""
        if getattr(self, "ws", None) is not None:
            self.ws.close()
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()
