"""Serve a local directory over HTTP on loopback, as a store the http source can mount:
byte ranges for reads and nginx's JSON directory index for listing.

nginx is used when installed (it serves files with sendfile and is never the bottleneck);
otherwise a small aiohttp server with the same index format runs in its own process.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from email.utils import formatdate
from pathlib import Path

from aiohttp import web

from gpufeed.bench.children import free_port, helper, python_module, until_parent_exits
from gpufeed.errors import InvalidArgument

NGINX_CONF = """
daemon off;
master_process off;
pid {run}/nginx.pid;
error_log {run}/nginx-error.log warn;
events {{ worker_connections 1024; }}
http {{
    access_log {access_log};
    sendfile on;
    keepalive_requests 1000000;
    client_body_temp_path {run}/body;
    proxy_temp_path {run}/proxy;
    fastcgi_temp_path {run}/fastcgi;
    uwsgi_temp_path {run}/uwsgi;
    scgi_temp_path {run}/scgi;
    server {{
        listen 127.0.0.1:{port};
        location / {{
            root {root};
            autoindex on;
            autoindex_format {index};
        }}
    }}
}}
"""


def find_nginx() -> str | None:
    return shutil.which("nginx") or next((p for p in ("/usr/sbin/nginx", "/usr/local/sbin/nginx") if os.access(p, os.X_OK)), None)


@contextmanager
def serving(
    root: Path, run_dir: Path, *, prefer_nginx: bool = True, access_log: Path | None = None, index: str = "json"
) -> Iterator[str]:
    """Serve `root` until the block ends; yields the base URL (http://127.0.0.1:PORT).
    `run_dir` holds the server's config and logs. With `access_log`, nginx logs every request
    there (to count what reached the store); that needs nginx. `index="html"` lists directories
    as web pages (what other tools' HTTP remotes parse, rclone's among them); that needs nginx too."""
    nginx = find_nginx() if prefer_nginx or access_log or index != "json" else None
    run_dir.mkdir(parents=True, exist_ok=True)
    if (access_log is not None or index != "json") and nginx is None:
        what = "counting requests at the server" if access_log is not None else "an HTML directory index"
        raise InvalidArgument(f"{what} needs nginx (apt-get install nginx-light)")
    if nginx is not None:
        port = free_port()
        conf = run_dir / "nginx.conf"
        log = str(access_log) if access_log is not None else "off"
        conf.write_text(NGINX_CONF.format(run=run_dir, port=port, root=root.resolve(), access_log=log, index=index))
        argv = [nginx, "-c", str(conf), "-e", str(run_dir / "nginx-error.log")]
        with helper(argv, "nginx", run_dir / "nginx.log", port=port):
            yield f"http://127.0.0.1:{port}"
    else:
        argv = python_module("gpufeed.bench.server", str(root.resolve()))
        with helper(argv, "the Python HTTP server", run_dir / "http-server.log") as port:
            yield f"http://127.0.0.1:{port}"


def _index(directory: Path) -> list[dict[str, object]]:
    """The directory as nginx's `autoindex_format json` writes it."""
    entries: list[dict[str, object]] = []
    for entry in sorted(os.scandir(directory), key=lambda e: e.name):
        info = entry.stat()
        item: dict[str, object] = {"name": entry.name, "type": "directory" if entry.is_dir() else "file"}
        item["mtime"] = formatdate(info.st_mtime, usegmt=True)
        if not entry.is_dir():
            item["size"] = info.st_size
        entries.append(item)
    return entries


def application(root: Path) -> web.Application:
    root = root.resolve()

    async def get(request: web.Request) -> web.StreamResponse:
        target = (root / request.match_info["path"]).resolve()
        if not target.is_relative_to(root) or not target.exists():
            raise web.HTTPNotFound()
        if target.is_dir():
            if not request.path.endswith("/"):
                raise web.HTTPMovedPermanently(request.path + "/")
            return web.json_response(_index(target))
        since = request.if_unmodified_since
        if since is not None:
            # HTTP dates have whole seconds, as the index's mtimes do; compare at that precision
            # (aiohttp would compare the sub-second mtime and refuse every pinned read).
            if int(target.stat().st_mtime) > since.timestamp():
                raise web.HTTPPreconditionFailed()
            headers = {k: v for k, v in request.headers.items() if k.lower() != "if-unmodified-since"}
            response = web.FileResponse(target)
            await response.prepare(request.clone(headers=headers))
            return response
        return web.FileResponse(target)

    app = web.Application()
    app.router.add_get("/{path:.*}", get)
    return app


async def _serve(root: Path, port: int) -> None:
    runner = web.AppRunner(application(root), access_log=None)
    await runner.setup()
    try:
        await web.TCPSite(runner, "127.0.0.1", port).start()
        sys.stdout.write(f"{runner.addresses[0][1]}\n")
        sys.stdout.flush()
        await until_parent_exits()
    finally:
        await runner.cleanup()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m gpufeed.bench.server", description="Serve a directory on loopback.")
    parser.add_argument("root", type=Path)
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        asyncio.run(_serve(args.root, args.port))
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
