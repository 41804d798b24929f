"""The local RPC between clients and the node agent: length-prefixed JSON over a Unix socket.

The socket lives in the abstract namespace (no file to go stale after a crash), named by the
primary cache dir, so "the agent for this cache dir" is found without any shared state.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import struct
from pathlib import Path
from typing import Any

import xxhash

from gpufeed import errors

_LENGTH = struct.Struct("<I")
MAX_MESSAGE = 64 << 20
VERSION = 3
"""What the agent and its clients must agree on; the agent says it in `hello`. Raise it with
any change a running agent of the last release would misread or not do (2: one-way messages,
hit reports as one string of names; 3: the agent counts its deletions of block files, which
readers holding files open rely on)."""


def address(cache_dir: Path) -> str:
    return "\0gpufeed-agent-" + xxhash.xxh3_64_hexdigest(os.path.realpath(cache_dir).encode())


def encode(message: dict[str, Any]) -> bytes:
    body = json.dumps(message, separators=(",", ":")).encode()
    return _LENGTH.pack(len(body)) + body


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    buffer = bytearray(n)
    view = memoryview(buffer)
    got = 0
    while got < n:
        chunk = sock.recv_into(view[got:])
        if chunk == 0:
            raise ConnectionResetError("agent closed the connection")
        got += chunk
    return bytes(buffer)


def recv(sock: socket.socket) -> dict[str, Any]:
    (length,) = _LENGTH.unpack(_recv_exactly(sock, _LENGTH.size))
    if length > MAX_MESSAGE:
        raise ConnectionResetError(f"agent message of {length} bytes exceeds the limit")
    return json.loads(_recv_exactly(sock, length))


async def read_message(reader: asyncio.StreamReader) -> dict[str, Any] | None:
    try:
        (length,) = _LENGTH.unpack(await reader.readexactly(_LENGTH.size))
        if length > MAX_MESSAGE:
            return None
        return json.loads(await reader.readexactly(length))
    except (asyncio.IncompleteReadError, ConnectionError):
        return None


def error_from(failure: dict[str, Any]) -> errors.GpufeedError:
    """Rebuild the typed error an agent reported, so callers can catch ObjectChanged etc."""
    cls = getattr(errors, failure.get("error", ""), None)
    if not (isinstance(cls, type) and issubclass(cls, errors.GpufeedError)):
        cls = errors.SourceError
    return cls(failure.get("message", "agent error"))
