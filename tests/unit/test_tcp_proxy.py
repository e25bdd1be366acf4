"""The tests' TCP proxy (tests/tcp_proxy.py) and the fault proxies built on it, against a loopback echo server."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest

from tests.fault.gate_proxy import GateProxy
from tests.fault.lag_proxy import LagProxy
from tests.tcp_proxy import ReplyCutter, TcpProxy


@pytest.fixture
def echo_port() -> Iterator[int]:
    server = socket.create_server(("127.0.0.1", 0))

    def echo(conn: socket.socket) -> None:
        with conn:
            while data := conn.recv(65536):
                conn.sendall(data)

    def serve() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            threading.Thread(target=echo, args=(conn,), daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    yield server.getsockname()[1]
    server.close()


def roundtrip(port: int, data: bytes, timeout_s: float = 10) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as conn:
        conn.sendall(data)
        return conn.recv(65536)


def test_a_plain_proxy_passes_bytes_both_ways(echo_port: int) -> None:
    with TcpProxy(echo_port) as proxy:
        assert roundtrip(proxy.port, b"ping") == b"ping"
        assert proxy.url == f"http://127.0.0.1:{proxy.port}"


def test_the_gate_holds_the_matching_request_until_released(echo_port: int) -> None:
    with GateProxy(echo_port) as gate:
        gate.hold("PUT /held")
        answers: list[bytes] = []
        sender = threading.Thread(target=lambda: answers.append(roundtrip(gate.port, b"PUT /held 1")), daemon=True)
        sender.start()
        assert gate.wait_held(10)
        assert gate.held_request == b"PUT /held 1" and answers == []
        assert roundtrip(gate.port, b"GET /other") == b"GET /other"  # another connection passes
        gate.release()
        sender.join(10)
        assert answers == [b"PUT /held 1"]


def test_the_reply_cutter_drops_the_armed_request_s_reply_and_closes(echo_port: int) -> None:
    with ReplyCutter(echo_port) as proxy:
        assert roundtrip(proxy.port, b"EVALSHA 1") == b"EVALSHA 1"  # not armed
        proxy.arm(rb"EVALSHA")
        assert roundtrip(proxy.port, b"EVALSHA 2") == b""  # the connection ends, no reply
        assert proxy.cut_reply.is_set()


def test_the_lag_proxy_delays_replies_and_its_cut_drops_them(echo_port: int) -> None:
    with LagProxy(echo_port, lag_s=0.5) as lag:
        started = time.monotonic()
        assert roundtrip(lag.port, b"sync") == b"sync"
        assert time.monotonic() - started >= 0.5
    with LagProxy(echo_port, lag_s=60) as lag, socket.create_connection(("127.0.0.1", lag.port), timeout=10) as conn:
        conn.sendall(b"lost")
        lag.cut()
        try:
            got = conn.recv(65536)
        except ConnectionResetError:  # closed with the bytes it had not read yet
            got = b""
        assert got == b""  # dropped with the connection
