"""colictl's one way to talk to colibrid: a DEALER socket speaking daemon/protocol.py.
No numpy, no numba: this path must start fast.

Every wait is bounded. A reply is awaited at most `timeout_s`; a generate stream may take
long between two messages (a long prompt on a slow disk), so while it is silent the client
pings the daemon every `heartbeat_s` on the same connection (the daemon's I/O thread
answers at once, whatever the engine does) and gives up when a ping goes unanswered. A
socket monitor reports a connection the daemon closed (it stopped, or dropped a far too
large message) at once."""

import itertools
import os
import socket
import stat
import time

import zmq

from ..daemon import protocol as P

CANCEL_POLL_S = 0.1  # how often a wait that may be cancelled looks at its cancel flag


class DaemonDown(Exception):
    """No colibrid answers on the socket, or it stopped answering mid-request."""


class ConnectionClosed(DaemonDown):
    """The daemon closed the connection mid-request."""


class PermissionDenied(Exception):
    """The socket exists but this user may not use it."""


class BadSocket(Exception):
    """The socket path is not a filesystem path (e.g. tcp://...)."""


class TooLarge(Exception):
    """A request larger than the daemon takes (its max_message_bytes): never sent."""


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
                 operator_path: str | None = None, heartbeat_s: float = 2.0):
        self.path = socket_path or os.environ.get("COLIBRI_SOCKET") or P.default_socket()
        if operator:
            self.path = operator_path or P.operator_socket(self.path)
        self.timeout_ms = int(timeout_s * 1000)
        self.heartbeat_s = heartbeat_s
        self.max_message_bytes: int | None = None  # the daemon's limit, from the hello reply
        self.largest_sent = 0  # bytes of the largest request sent (a close after a huge one is its refusal)
        self.ctx = zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.monitor = None
        self.connected = False
        self.wait_s = 0.0  # how long the first send waits for a daemon that is starting
        self.ids = (f"{os.getpid()}-{i}" for i in itertools.count(1))

    def connect(self, wait_s: float = 0) -> "Client":
        """Raises BadSocket for a path with a scheme, DaemonDown when nothing listens on
        the socket file (none, or a stale one a killed daemon left) and none does within
        `wait_s` (a daemon starting), PermissionDenied when this user may not use it."""
        deadline = time.monotonic() + wait_s
        while True:
            try:
                return self._connect()
            except DaemonDown:
                if time.monotonic() >= deadline:
                    raise
                time.sleep(0.1)

    def _connect(self) -> "Client":
        why = P.socket_path_problem(self.path)
        if why:
            raise BadSocket(f"{self.path!r}: {why}")
        try:
            st = os.stat(self.path)
        except PermissionError:
            raise PermissionDenied(f"permission denied: cannot reach {self.path} (its directory is closed to "
                                   "this user)") from None
        except (FileNotFoundError, NotADirectoryError):
            raise DaemonDown(f"colibrid is not running (no socket at {self.path})") from None
        if not stat.S_ISSOCK(st.st_mode):
            raise DaemonDown(f"colibrid is not running ({self.path} is not a socket)")
        if not os.access(self.path, os.R_OK | os.W_OK):
            import grp

            try:
                group = grp.getgrgid(st.st_gid).gr_name
            except KeyError:
                group = str(st.st_gid)
            raise PermissionDenied(f"permission denied on {self.path}: it is for group {group!r}; ask an "
                                   f"administrator to add you to it")
        self._probe()
        self.monitor = self.sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self.sock.connect(P.endpoint(self.path))
        self.connected = True
        return self

    def _probe(self) -> None:
        # libzmq retries a refused ipc connect in the background, forever: a plain connect
        # tells a stale socket file from a live daemon at once
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(self.timeout_ms / 1000)
        try:
            s.connect(self.path)
        except ConnectionRefusedError:
            raise DaemonDown(f"colibrid is not running ({self.path} is a stale socket: nothing listens on it)") \
                from None
        except PermissionError:
            raise PermissionDenied(f"permission denied on {self.path}") from None
        except OSError as e:
            raise DaemonDown(f"colibrid does not answer on {self.path} ({e.strerror or e})") from None
        finally:
            s.close()

    def send(self, kind: str, **fields) -> str:
        """Send one request (connecting first, within `wait_s`, if not yet connected);
        returns its id. Raises TooLarge (nothing sent) for a request above the daemon's
        limit, and what connect raises."""
        if not self.connected:
            self.connect(self.wait_s)
        rid = next(self.ids)
        frame = P.encode(P.request(kind, rid, **fields))
        if self.max_message_bytes and len(frame) > self.max_message_bytes:
            raise TooLarge(f"the request is {len(frame)} bytes, above the daemon's max_message_bytes of "
                           f"{self.max_message_bytes} (its configuration sets it)")
        self.sock.send(frame)
        self.largest_sent = max(self.largest_sent, len(frame))
        return rid

    def recv(self, timeout_ms: int | None) -> dict:
        """The next message. Raises DaemonDown when none comes within timeout_ms (None:
        no limit) or the daemon closes the connection."""
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        if self.monitor is not None:
            poller.register(self.monitor, zmq.POLLIN)
        ready = dict(poller.poll(timeout_ms))
        if self.sock in ready:  # a message that arrived before a disconnect is still read
            return P.decode(self.sock.recv())
        if self.monitor is not None and self.monitor in ready:
            self.monitor.recv_multipart()
            # the daemon drops a peer whose message is above 4x its limit (MAXMSGSIZE); any
            # other close is the daemon going away (stopped, killed, crashed)
            known = self.max_message_bytes or P.DEFAULT_MAX_MESSAGE_BYTES
            why = (f"the {self.largest_sent}-byte request was far larger than it takes"
                   if self.largest_sent > 4 * known else "it stopped or was killed")
            raise ConnectionClosed(f"colibrid closed the connection on {self.path} ({why})")
        raise DaemonDown(f"colibrid does not answer on {self.path}")

    def reply_to(self, rid: str, timeout_ms: int | None = -1, stream=None, cancel=None) -> dict:
        """Wait for the final reply to request `rid` and return it (ok or error); each
        generate_stream event of it goes to `stream`. An error reply with a null id answers
        a message the daemon could not read: the one this client waits for.
        With timeout_ms None the wait is as long as the daemon answers pings. `cancel`: a
        threading.Event another thread may set; the request is then cancelled (a
        cancel_request) and its final reply still awaited."""
        limit = self.timeout_ms if timeout_ms == -1 else timeout_ms
        deadline = None if limit is None else time.monotonic() + limit / 1000
        ping = None  # (id, sent at) of the heartbeat in flight
        heard = time.monotonic()  # when the daemon last said something
        asked_cancel = False
        while True:
            if cancel is not None and cancel.is_set() and not asked_cancel:
                self.send("cancel", target=rid)
                asked_cancel = True
            now = time.monotonic()
            wait = heard + self.heartbeat_s - now if limit is None else deadline - now
            if ping is not None:
                wait = min(wait, ping[1] + self.timeout_ms / 1000 - now)
            if cancel is not None and not asked_cancel:
                wait = min(wait, CANCEL_POLL_S)
            try:
                msg = self.recv(int(max(wait, 0) * 1000))
            except DaemonDown as e:
                now = time.monotonic()
                if isinstance(e, ConnectionClosed) or (limit is not None and now >= deadline):
                    raise
                if ping is not None and now >= ping[1] + self.timeout_ms / 1000:
                    raise DaemonDown(f"colibrid stopped answering on {self.path} (no reply to a ping in "
                                     f"{self.timeout_ms / 1000:.0f} s)") from None
                if ping is None and limit is None and now >= heard + self.heartbeat_s:
                    ping = (self.send("ping"), now)
                continue
            heard = time.monotonic()
            mid = msg.get("id")
            if ping is not None and mid == ping[0]:
                ping = None
                continue
            if mid == rid or (mid is None and msg.get("status") == "error"):
                if msg.get("type") == "generate_stream":
                    if stream is not None:
                        stream(msg)
                    continue
                return msg

    def call(self, kind: str, timeout_ms: int | None = -1, **fields) -> dict:
        """One request, its reply. Raises DaemonDown, ReplyError, TooLarge."""
        msg = self.reply_to(self.send(kind, **fields), timeout_ms)
        if msg.get("status") != "ok":
            raise ReplyError(msg)
        return msg

    def hello(self) -> dict:
        """The handshake: checks that the daemon speaks our protocol major version and
        learns its limits."""
        r = self.call("hello", protocol=P.PROTOCOL_VERSION, client="colictl")
        limit = r.get("max_message_bytes")
        self.max_message_bytes = limit if isinstance(limit, int) and not isinstance(limit, bool) else None
        return r

    def close(self) -> None:
        if self.monitor is not None:
            self.sock.disable_monitor()
            self.monitor.close(0)
        self.sock.close(0)
