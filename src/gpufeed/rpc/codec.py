"""Framing: a 4-byte length, then one msgpack-encoded message, over a Unix socket.

The socket lives in the abstract namespace (no file to go stale after a crash), named by the
primary cache dir, so "the agent for this cache dir" is found without any shared state.
"""

from __future__ import annotations

import asyncio
import os
import socket
import struct
from pathlib import Path

import msgspec
import xxhash

from gpufeed.rpc.messages import Reply, Request

VERSION = 12
"""What the agent and its readers must agree on; checked by `Hello` on every connection. Raise it
with any change a running agent of the last release would misread or not do (4: typed msgpack
messages; block headers that record the block's identity; 5: hit reports carry per-mount
figures, groups name their mount, Metrics and Usage requests; 6: prefetch requests carry the
job's lead in samples, and usage reports it; 7: writes: Commit, Sync, Remove; 8: Fetch.at_owners, the
cluster warmup; 9: ReadRanges, reads around blocks for readers that cannot reach a store; 10: objects carry
the chunk sums a pack index lists, which the agent checks every fetched block against; 11: objects
name their sums by a hash, and a request carries those of the blocks it wants, `ObjectWant.sums`;
12: hit reports carry the reader's own store reads, `Served.direct`, and `ReadRanges` serves writes
still uploading from their staged bytes)."""
MAX_MESSAGE = 64 << 20
_LENGTH = struct.Struct("<I")
_encoder = msgspec.msgpack.Encoder()
_requests = msgspec.msgpack.Decoder(Request)
_replies = msgspec.msgpack.Decoder(Reply)


class ProtocolError(Exception):
    """A frame that is not a message of this protocol version."""


def address(cache_dir: Path) -> str:
    return "\0gpufeed-agent-" + xxhash.xxh3_64_hexdigest(os.path.realpath(cache_dir).encode())


_PEER = struct.Struct("3i")  # struct ucred: pid, uid, gid


def peer(sock: socket.socket) -> tuple[int, int]:
    """The pid and uid of the process at the other end of a connected Unix socket, as the
    kernel recorded them when it connected (SO_PEERCRED): the agent's readers, a reader's agent."""
    pid, uid, _ = _PEER.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEER.size))
    return pid, uid


def frame(message: msgspec.Struct) -> bytes:
    body = _encoder.encode(message)
    return _LENGTH.pack(len(body)) + body


def _recv_exactly(sock: socket.socket, n: int) -> bytearray:
    buffer = bytearray(n)
    view = memoryview(buffer)
    got = 0
    while got < n:
        chunk = sock.recv_into(view[got:])
        if chunk == 0:
            raise ConnectionResetError("the agent closed the connection")
        got += chunk
    return buffer


def recv_reply(sock: socket.socket) -> Reply:
    (length,) = _LENGTH.unpack(_recv_exactly(sock, _LENGTH.size))
    if length > MAX_MESSAGE:
        raise ProtocolError(f"agent message of {length} bytes exceeds the limit")
    try:
        return _replies.decode(_recv_exactly(sock, length))
    except msgspec.DecodeError as exc:
        raise ProtocolError(f"unreadable reply from the agent: {exc}") from None


async def read_request(reader: asyncio.StreamReader) -> Request | None:
    """The next request; None when the reader hung up. ProtocolError for a frame of another kind."""
    try:
        (length,) = _LENGTH.unpack(await reader.readexactly(_LENGTH.size))
        if length > MAX_MESSAGE:
            raise ProtocolError(f"request of {length} bytes exceeds the limit")
        body = await reader.readexactly(length)
    except (asyncio.IncompleteReadError, ConnectionError):
        return None
    try:
        return _requests.decode(body)
    except msgspec.DecodeError as exc:
        raise ProtocolError(str(exc)) from None
