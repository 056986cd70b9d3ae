"""colictl's one way to talk to colibrid: a DEALER socket speaking daemon/protocol.py.
No numpy, no numba: this path must start fast."""

import itertools
import os

import zmq

from ..daemon import protocol as P


class DaemonDown(Exception):
    """No colibrid answers on the socket."""


class ReplyError(Exception):
    """The daemon answered with an error; `name`, `code`, and the reply itself."""

    def __init__(self, reply: dict):
        err = reply.get("error") or {}
        super().__init__(err.get("message", "error"))
        self.name, self.code, self.reply = err.get("name", "INTERNAL"), err.get("code", 10), reply


class Client:
    def __init__(self, socket_path: str | None = None, timeout_s: float = 5.0):
        self.path = socket_path or os.environ.get("COLIBRI_SOCKET") or P.default_socket()
        self.timeout_ms = int(timeout_s * 1000)
        self.ctx = zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.ids = (f"{os.getpid()}-{i}" for i in itertools.count(1))

    def connect(self) -> "Client":
        """Raises DaemonDown when there is no socket file to connect to."""
        if not self.path.startswith(("tcp://", "ipc://")) and not os.path.exists(self.path):
            raise DaemonDown(f"colibrid is not running (no socket at {self.path})")
        self.sock.connect(P.endpoint(self.path))
        return self

    def send(self, kind: str, **fields) -> str:
        rid = next(self.ids)
        self.sock.send(P.encode(P.request(kind, rid, **fields)))
        return rid

    def recv(self, timeout_ms: int | None) -> dict:
        """The next message; raises DaemonDown when none comes within timeout_ms (None: wait)."""
        if not self.sock.poll(timeout_ms if timeout_ms is not None else -1):
            raise DaemonDown(f"colibrid does not answer on {self.path}")
        return P.decode(self.sock.recv())

    def call(self, kind: str, timeout_ms: int | None = -1, **fields) -> dict:
        """One request, its reply. Raises DaemonDown, ReplyError."""
        rid = self.send(kind, **fields)
        while True:
            msg = self.recv(self.timeout_ms if timeout_ms == -1 else timeout_ms)
            if msg.get("id") == rid and msg["type"].endswith("_reply"):
                if msg.get("status") != "ok":
                    raise ReplyError(msg)
                return msg

    def hello(self) -> dict:
        """The handshake: checks that the daemon speaks our protocol major version."""
        return self.call("hello", protocol=P.PROTOCOL_VERSION, client="colictl")

    def close(self) -> None:
        self.sock.close(0)
