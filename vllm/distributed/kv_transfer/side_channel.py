"""The NIXL handshake's side channel: a ZMQ request/reply over TCP, msgpack bodies.

Every producer rank serves one ``SideChannelServer`` (a daemon thread; replies are precomputed
bytes, so the thread touches no NIXL state). A consumer rank asks with
:func:`side_channel_request`, which times out instead of hanging when the producer is gone.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable

import msgspec
import zmq


class SideChannelServer:
    """Answers each request ``{...}`` with ``handler(request)`` on tcp://host:port."""

    def __init__(self, host: str, port: int, handler: Callable[[dict], dict]):
        self.host, self.port, self.handler = host, port, handler
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        try:
            self._sock.bind(f"tcp://{host}:{port}")
        except zmq.ZMQError as e:
            self._sock.close()
            self._ctx.term()
            raise RuntimeError(
                f"KV side channel cannot listen on {host}:{port} ({e}); choose another "
                "side_channel_port in --kv-transfer-config"
            ) from e
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="kv-side-channel", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(100):
                continue
            ident, _, body = self._sock.recv_multipart()
            try:
                reply = self.handler(msgspec.msgpack.decode(body))
            except Exception as e:  # a bad request must not kill the server
                reply = {"error": f"{type(e).__name__}: {e}"}
            self._sock.send_multipart([ident, b"", msgspec.msgpack.encode(reply)])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self._sock.close()
        self._ctx.term()


def side_channel_request(host: str, port: int, request: dict, timeout_s: float) -> dict:
    """One request/reply; ``TimeoutError`` when nobody answers within ``timeout_s``,
    ``ConnectionRefusedError`` at once when nothing listens there (a dead producer: ZMQ alone
    would retry silently until the timeout)."""
    with socket.create_connection((host, port), timeout=timeout_s):
        pass
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.REQ)
    ms = max(1, int(timeout_s * 1000))
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDTIMEO, ms)
    sock.setsockopt(zmq.RCVTIMEO, ms)
    try:
        sock.connect(f"tcp://{host}:{port}")
        sock.send(msgspec.msgpack.encode(request))
        reply = msgspec.msgpack.decode(sock.recv())
    except zmq.Again as e:
        raise TimeoutError(f"KV side channel {host}:{port}: no answer in {timeout_s:.1f} s") from e
    finally:
        sock.close()
    if "error" in reply:
        raise RuntimeError(f"KV side channel {host}:{port}: {reply['error']}")
    return reply
