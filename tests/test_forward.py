"""The loopback relay (testbed/net/forward.py) without root: relayed inside this namespace.

The root test (tests/test_up_root.py) relays into a Mininet host's namespace through setns.
"""

import socket
import threading

import pytest

from testbed.net.forward import Forward


def _echo_server():
    """A TCP server on loopback that echoes each connection's bytes upper-cased, then closes."""
    srv = socket.create_server(("127.0.0.1", 0))

    def serve():
        while True:
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            with conn:
                data = b""
                while chunk := conn.recv(4096):
                    data += chunk
                conn.sendall(data.upper())

    threading.Thread(target=serve, daemon=True).start()
    return srv


def _exchange(addr, payload):
    with socket.create_connection(addr, timeout=5) as c:
        c.sendall(payload)
        c.shutdown(socket.SHUT_WR)          # the relay carries the half-close through
        got = b""
        while chunk := c.recv(65536):
            got += chunk
    return got


def test_relays_both_ways_with_half_close_and_stops():
    srv = _echo_server()
    fwd = Forward(None, srv.getsockname()).start()
    try:
        host, port = fwd.address
        assert host == "127.0.0.1" and port > 0
        payload = bytes(range(256)) * 1000 + b"abc"
        assert _exchange(fwd.address, payload) == payload.upper()
        assert _exchange(fwd.address, b"second") == b"SECOND"
        assert fwd.connections == 2
    finally:
        fwd.stop()
        srv.close()
    with pytest.raises(OSError):
        socket.create_connection(fwd.address, timeout=2)


def test_refuses_a_non_loopback_listen_address():
    with pytest.raises(ValueError, match="loopback only"):
        Forward(None, ("10.0.0.1", 8000), host="0.0.0.0")


def test_a_port_in_use_is_one_clear_error():
    from testbed.errors import NetworkError
    busy = socket.create_server(("127.0.0.1", 0))
    try:
        with pytest.raises(NetworkError, match="cannot listen"):
            Forward(None, ("127.0.0.1", 9), port=busy.getsockname()[1]).start()
    finally:
        busy.close()
