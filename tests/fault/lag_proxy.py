"""A TCP proxy on loopback that delays one direction, to give a Redis replica a replication lag.

On one machine a replica is never behind: the primary writes a reply and the replication stream in
the same turn of its event loop, and a SIGKILLed process's sent bytes still arrive. A lost machine
(or a network partition) loses what was on its way to the replica. ``LagProxy`` models that: the
replica replicates through it, the primary's bytes reach it ``lag_s`` late, and ``cut()`` drops
whatever is still on its way, as the machine's death would.
"""

from __future__ import annotations

import threading
import time
from collections import deque

from tests.tcp_proxy import Link, TcpProxy


class LagProxy(TcpProxy):
    name = "lag-proxy"
    backlog = 8

    def __init__(self, upstream_port: int, lag_s: float) -> None:
        super().__init__(upstream_port)
        self.lag_s = lag_s

    def requests(self, link: Link) -> None:
        self.pump(link.client, link.upstream, link, self.on_request, close_at_end=False)

    def replies(self, link: Link) -> None:
        """The primary's bytes, each sent on by a thread of its own ``lag_s`` after they came."""
        queue: deque[tuple[float, bytes]] = deque()
        ready = threading.Condition()

        def send() -> None:
            try:
                while not self.stopped:
                    with ready:
                        while not queue and not self.stopped:
                            ready.wait(0.05)
                        if self.stopped:
                            return
                        due, data = queue[0]
                    if (wait := due - time.monotonic()) > 0:
                        time.sleep(wait)
                    with ready:
                        queue.popleft()
                    if self.stopped:
                        return
                    link.client.sendall(data)
            except OSError:
                pass

        threading.Thread(target=send, name="lag-proxy-send", daemon=True).start()
        try:
            while not self.stopped:
                data = link.upstream.recv(65536)
                if not data:
                    break
                with ready:
                    queue.append((time.monotonic() + self.lag_s, data))
                    ready.notify()
        except OSError:
            pass

    def __exit__(self, *_: object) -> None:
        self.cut()
