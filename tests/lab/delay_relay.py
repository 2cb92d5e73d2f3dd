"""A one-way delay on the path from one lab host to another, in user space: `netem` is not available on
this kernel. Run by Lab.delay_path as `ip netns exec FROM python delay_relay.py FROM_TUN TO_NETNS TO_TUN MS`:
it opens a TUN device in FROM's namespace (where a route sends TO's address into it) and one in TO's
namespace, and writes every packet read from the first into the second MS milliseconds later, in order.
TO's kernel receives them as if they had come over a slow link; its answers go back the normal way, so the
round trip from FROM to TO grows by MS and no other path changes. Prints "ready" once both devices exist.
Needs Python 3.12 (os.setns)."""

from __future__ import annotations

import collections
import fcntl
import os
import select
import struct
import sys
import time

TUNSETIFF = 0x400454CA
IFF_TUN, IFF_NO_PI = 0x0001, 0x1000


def open_tun(name: str) -> int:
    fd = os.open("/dev/net/tun", os.O_RDWR)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TUN | IFF_NO_PI))
    return fd


def main() -> None:
    from_tun, to_netns, to_tun, delay_ms = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
    source = open_tun(from_tun)
    netns = os.open(f"/run/netns/{to_netns}", os.O_RDONLY)
    os.setns(netns, os.CLONE_NEWNET)
    os.close(netns)
    sink = open_tun(to_tun)
    print("ready", flush=True)
    delay = delay_ms / 1000.0
    queue: collections.deque[tuple[float, bytes]] = collections.deque()
    while True:
        wait = max(0.0, queue[0][0] - time.monotonic()) if queue else None
        readable, _, _ = select.select([source], [], [], wait)
        if readable:
            queue.append((time.monotonic() + delay, os.read(source, 65536)))
        now = time.monotonic()
        while queue and queue[0][0] <= now:
            os.write(sink, queue.popleft()[1])


if __name__ == "__main__":
    main()
