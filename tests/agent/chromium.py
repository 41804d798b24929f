"""Debian's headless Chromium, driven over the DevTools protocol (a websocket; aiohttp speaks it),
so a test sees a page as a browser runs it: scripts executed, canvases drawn."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import shutil
import signal
import subprocess
import tempfile
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp

from gpufeed.bench.children import free_port
from tests.conftest import need_binary


class Page:
    """One tab: evaluate JavaScript, take screenshots."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        self.ws = ws
        self._next = 0

    async def call(self, method: str, **params: Any) -> dict[str, Any]:
        self._next += 1
        await self.ws.send_json({"id": self._next, "method": method, "params": params})
        while True:
            message = json.loads((await self.ws.receive()).data)
            if message.get("id") == self._next:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return message["result"]

    async def evaluate(self, expression: str) -> Any:
        result = await self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        return result["result"].get("value")

    async def wait_for(self, expression: str, timeout: float = 20.0) -> Any:
        """The expression's value once it is truthy (the page polls on its own clock)."""
        deadline = asyncio.get_running_loop().time() + timeout
        while not (value := await self.evaluate(expression)):
            if asyncio.get_running_loop().time() > deadline:
                raise AssertionError(f"never true in the page: {expression}")
            await asyncio.sleep(0.2)
        return value

    async def screenshot(self, path: Path) -> None:
        shot = await self.call("Page.captureScreenshot", format="png")
        path.write_bytes(base64.b64decode(shot["data"]))


@contextlib.asynccontextmanager
async def open_page(url: str, width: int = 1200, height: int = 820) -> AsyncIterator[Page]:
    binary = shutil.which("chromium") or need_binary("chromium")
    port = free_port()
    # chromium's helper processes may still be writing the profile as they die: a leftover file
    # in a temporary directory is not the test's failure
    with tempfile.TemporaryDirectory(ignore_cleanup_errors=True) as profile:
        argv = [binary, "--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run",
                f"--user-data-dir={profile}", f"--remote-debugging-port={port}", f"--window-size={width},{height}",
                "about:blank"]
        browser = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        try:
            ws_url = await _page_socket(port)
            async with aiohttp.ClientSession() as session, session.ws_connect(ws_url, max_msg_size=0) as ws:
                page = Page(ws)
                await page.call("Page.enable")
                await page.call("Page.navigate", url=url)
                yield page
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(browser.pid, signal.SIGKILL)  # the browser and its renderer, GPU and network processes
            browser.wait()


async def _page_socket(port: int) -> str:
    for _ in range(200):
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=1) as response:
                targets = json.loads(response.read())
            return next(t["webSocketDebuggerUrl"] for t in targets if t["type"] == "page")
        except (OSError, StopIteration, ValueError):
            await asyncio.sleep(0.1)
    raise AssertionError("chromium's DevTools endpoint never came up")
