"""colictl's one way to talk to colibrid: a DEALER socket speaking daemon/protocol.py.
No numpy, no numba: this path must start fast."""

import itertools
import os

import zmq

from ..daemon import protocol as P


class DaemonDown(Exception):
    """No colibrid answers on the socket."""


class PermissionDenied(Exception):
    """The socket exists but this user may not use it."""


class ReplyError(Exception):
    """The daemon answered with an error; `name`, `code`, and the reply itself."""

    def __init__(self, reply: dict):
        err = reply.get("error") or {}
        super().__init__(err.get("message", "error"))
        self.name, self.code, self.reply = err.get("name", "INTERNAL"), err.get("code", 10), reply


class Client:
    """A connection to the user socket, or with `operator` to the operator socket
    (`operator_path`, else COLIBRI_OPERATOR_SOCKET, else next to the user socket)."""

    def __init__(self, socket_path: str | None = None, timeout_s: float = 5.0, operator: bool = False,
                 operator_path: str | None = None):
        self.path = socket_path or os.environ.get("COLIBRI_SOCKET") or P.default_socket()
        if operator:
            self.path = operator_path or P.operator_socket(self.path)
        self.timeout_ms = int(timeout_s * 1000)
        self.ctx = zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.ids = (f"{os.getpid()}-{i}" for i in itertools.count(1))

    def connect(self) -> "Client":
        """Raises DaemonDown when there is no socket file to connect to, PermissionDenied
        when this user may not use it."""
        if not self.path.startswith(("tcp://", "ipc://")):
            try:
                st = os.stat(self.path)
            except PermissionError:
                raise PermissionDenied(f"permission denied: cannot reach {self.path} (its directory is closed to "
                                       "this user)") from None
            except FileNotFoundError:
                raise DaemonDown(f"colibrid is not running (no socket at {self.path})") from None
            if not os.access(self.path, os.R_OK | os.W_OK):
                import grp

                try:
                    group = grp.getgrgid(st.st_gid).gr_name
                except KeyError:
                    group = str(st.st_gid)
                raise PermissionDenied(f"permission denied on {self.path}: it is for group {group!r}; ask an "
                                       f"administrator to add you to it")
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
