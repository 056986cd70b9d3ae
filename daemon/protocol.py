"""The control plane's wire format (docs/protocol.md is the authority; a test ties the
two together). Pure Python, no numpy: colictl imports this and nothing else of the daemon.

Transport: ZeroMQ, ROUTER in colibrid, DEALER in clients, on an ipc:// socket. Every
message is one frame of UTF-8 JSON, an object with at least `type`; requests carry `id`
(the client's choice, echoed in every message about that request) and `v` (the sender's
PROTOCOL_VERSION). Replies carry `status` "ok" or "error"; an error has `error`:
{"code", "name", "message"}. Unknown fields are ignored by both sides.
"""

import json
import logging
import os

PROTOCOL_VERSION = "1.6"  # major.minor: minors only add fields and messages
DEFAULT_MAX_MESSAGE_BYTES = 1 << 20  # a daemon's max_message_bytes unless its configuration says otherwise

# numbered errors: (code, name) -> what the client's user can do about it
ERRORS = {
    "BAD_MESSAGE": 1,  # not UTF-8 JSON, not an object, a field missing or of the wrong type
    "UNKNOWN_TYPE": 2,  # a message type this daemon does not handle
    "VERSION_MISMATCH": 3,  # the protocol major versions differ
    "INVALID_REQUEST": 4,  # well-formed but cannot run: sampling values, prompt too long, ...
    "BUSY": 5,  # the request queue is full: retry later
    "NOT_FOUND": 6,  # cancel of a request that is not running
    "CANCELLED": 7,  # the request was cancelled
    "SHUTTING_DOWN": 8,  # the daemon is stopping and takes no new work
    "MODEL_ERROR": 9,  # the model failed (e.g. an expert could not be read)
    "INTERNAL": 10,  # a bug in colibrid: the message says what, the log says more
    "TOO_LARGE": 11,  # (1.1) the request is larger than the daemon's max_message_bytes
    "FORBIDDEN": 12,  # (1.1) an operator request on the user socket
    "LOADING": 13,  # (1.2) the daemon is still loading its model: retry, or wait (status shows the phase)
}
ERROR_NAMES = {code: name for name, code in ERRORS.items()}

REQUEST_TYPES = ("hello", "ping", "status", "stats", "generate", "cancel", "session", "map", "cache", "pin", "unpin",
                 "policy", "reload", "kept", "shutdown")
USER_TYPES = ("hello", "ping", "status", "stats", "generate", "cancel", "session", "map")  # the user socket takes only these;
# the operator socket takes every type

DEFAULT_SOCKET_NAME = "colibri.sock"
OPERATOR_SOCKET_NAME = "colibri-operator.sock"


class ProtocolError(Exception):
    """A request that cannot be served as sent: a frame that does not decode, or what a
    daemon handler refuses. `name` is the ERRORS key to reply with, `fields` go into the
    error reply beside it (answer() builds it)."""

    def __init__(self, name: str, message: str, **fields):
        super().__init__(message)
        self.name, self.fields = name, fields


def encode(msg: dict) -> bytes:
    """One message as the frame that carries it. A string that is not valid Unicode (a lone
    surrogate, which JSON's \\ud800 escapes can carry in) is sent escaped, never raised on."""
    text = json.dumps(msg, separators=(",", ":"), ensure_ascii=False)
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError:
        return json.dumps(msg, separators=(",", ":")).encode("ascii")


def decode(frame: bytes) -> dict:
    """The message in a frame. Raises ProtocolError(BAD_MESSAGE) for anything but a JSON
    object with a string `type`."""
    try:
        msg = json.loads(frame.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ProtocolError("BAD_MESSAGE", f"not UTF-8 JSON: {e}") from None
    if not isinstance(msg, dict):
        raise ProtocolError("BAD_MESSAGE", f"a message is a JSON object, not {type(msg).__name__}")
    if not isinstance(msg.get("type"), str):
        raise ProtocolError("BAD_MESSAGE", "the message has no string field 'type'")
    return msg


def major(version) -> int | None:
    try:
        return int(str(version).split(".")[0])
    except ValueError:
        return None


def compatible(version) -> bool:
    """Whether a peer speaking `version` can talk to us (same major version)."""
    return major(version) == major(PROTOCOL_VERSION)


def request(kind: str, rid: str, **fields) -> dict:
    return {"type": f"{kind}_request", "id": rid, "v": PROTOCOL_VERSION, **fields}


def ok(kind: str, rid, **fields) -> dict:
    return {"type": f"{kind}_reply", "id": rid, "v": PROTOCOL_VERSION, "status": "ok", **fields}


def stream(rid: str, token_id: int, text: str) -> dict:
    """One generated token of request `rid`: a generate_stream event."""
    return {"type": "generate_stream", "id": rid, "v": PROTOCOL_VERSION, "token_id": token_id, "text": text}


def error(kind: str, rid, name: str, message: str, **fields) -> dict:
    """An error reply; `name` is a key of ERRORS; `fields` ride along (e.g. the tokens a
    cancelled generate had made)."""
    return {"type": f"{kind}_reply", "id": rid, "v": PROTOCOL_VERSION, "status": "error",
            "error": {"code": ERRORS[name], "name": name, "message": message}, **fields}


def refusal(kind: str, rid, e: ProtocolError) -> dict:
    """The error reply that says `e`."""
    return error(kind, rid, e.name, str(e), **e.fields)


def answer(kind: str, rid, handle) -> dict | None:
    """The reply to request `rid` of `kind`, from `handle()`: the fields of an ok reply, or
    None when the reply comes later (the daemon's engine thread sends it). A ProtocolError
    becomes its error reply; any other exception is a bug in the daemon: logged, and an
    INTERNAL error reply, so that a bad request costs one reply, never the daemon."""
    try:
        fields = handle()
    except ProtocolError as e:
        return refusal(kind, rid, e)
    except Exception as e:
        logging.getLogger("colibri.daemon").exception("handling a %s request", kind)
        return error(kind, rid, "INTERNAL", f"{type(e).__name__}: {e}")
    return None if fields is None else ok(kind, rid, **fields)


def default_socket() -> str:
    """Where colibrid listens when neither --socket nor COLIBRI_SOCKET says: the runtime
    directory systemd made (RUNTIME_DIRECTORY, /run/colibri), else $XDG_RUNTIME_DIR/colibri,
    else /tmp/colibri-UID (the fallback for a box without a per-user runtime directory)."""
    env = os.environ.get("COLIBRI_SOCKET")
    if env:
        return env
    candidates = []
    if os.environ.get("RUNTIME_DIRECTORY"):
        candidates.append(os.environ["RUNTIME_DIRECTORY"].split(":")[0])
    candidates.append("/run/colibri")
    for d in candidates:
        if os.path.exists(os.path.join(d, DEFAULT_SOCKET_NAME)) or (d != "/run/colibri" and os.path.isdir(d)):
            return os.path.join(d, DEFAULT_SOCKET_NAME)
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    base = os.path.join(xdg, "colibri") if xdg else f"/tmp/colibri-{os.getuid()}"
    return os.path.join(base, DEFAULT_SOCKET_NAME)


def operator_socket(user_socket: str) -> str:
    """The operator socket: COLIBRI_OPERATOR_SOCKET, else next to the user socket."""
    return os.environ.get("COLIBRI_OPERATOR_SOCKET") or os.path.join(os.path.dirname(user_socket),
                                                                      OPERATOR_SOCKET_NAME)


def socket_path_problem(path) -> str | None:
    """Why `path` cannot be a colibri socket, or None. Sockets are filesystem paths only:
    anything with a scheme (tcp://, ipc://, ...) is refused, so the daemon never listens on
    a network address."""
    if not isinstance(path, str) or not path:
        return "a socket is a filesystem path"
    if "://" in path:
        return "it is not a filesystem path: colibri sockets are Unix socket files, never network addresses"
    if "\0" in path:
        return "a socket path cannot contain a NUL byte"
    return None


def endpoint(socket_path: str) -> str:
    """The ZeroMQ endpoint of a socket file."""
    return f"ipc://{socket_path}"


def precision_text(p: dict) -> str:
    """What a model computes in, as every output says it: "dense bf16, experts int4 g64,
    activations int8 (LOSSY: ...)" (p: a model's precision(), as hello, status and replies carry it). A lossy choice
    is named with what it changed; nothing is said of the activations when they are float32."""
    g = f" g{p['group_size']}" if p.get("group_size") else ""
    matrices = f" (matrices {p['dense_int']})" if p.get("dense_int") else ""
    text = f"dense {p.get('dense')}{matrices}, experts {p.get('experts')}{g}"
    acts = p.get("activations") or "float32"
    if acts != "float32":
        text += f", activations {acts}"
    if not p.get("lossy"):
        return text
    src = p.get("source") or {}
    why = []
    if src and (src.get("experts") != p.get("experts") or src.get("dense") != p.get("dense") or p.get("dense_int")):
        why.append(f"converted from {src.get('experts', '?')} experts / {src.get('dense', '?')} dense")
    if acts != "float32":
        why.append(f"{acts} activations")
    return text + f" (LOSSY: {'; '.join(why) or 'converted'})"


def precision_tag(p: dict) -> str:
    """precision_text in one token, for an OpenAI reply's system_fingerprint:
    colibri-int4g64-a8-lossy, colibri-bf16."""
    g = f"g{p['group_size']}" if p.get("group_size") else ""
    acts = "-a8" if (p.get("activations") or "float32") == "int8" else ""
    dense = f"-d{p['dense_int'].split()[0]}" if p.get("dense_int") else ""
    return f"colibri-{p.get('experts')}{g}{dense}{acts}{'-lossy' if p.get('lossy') else ''}"


def kept_note(n: dict) -> str:
    """What became of a value kept with --persist at the start (a note of status's runtime.kept_at_start:
    daemon/kept.py)."""
    said = f"the configuration says {n['configured']}" + (
        f" ({n['configured_in']})" if n["configured_in"] != "default" else " (the default)")
    if n["applied"]:
        return f"{n['key']} {n['value']} from runtime.yaml, kept by `{n['by']}` at {n['at']}; {said}"
    return f"{n['key']} {n['value']} kept by `{n['by']}` at {n['at']} is not applied: {n['why']}"
