"""colictl's exit codes, one per kind of failure a shell script may want to tell apart.

This module is the one table: README.md and docs/protocol.md carry it rendered by
`markdown()` and `protocol_markdown()`, and a test fails when they disagree."""

OK = 0
INTERNAL = 1
USAGE = 2
MODEL = 3
BAD_REQUEST = 4
DAEMON_DOWN = 5
BUSY = 6
CHECK_FAILED = 7
PERMISSION = 8
LOADING = 9
INTERRUPTED = 130

MEANING = {  # code -> what it means, as the README's table says it
    OK: "done",
    INTERNAL: "an internal error (a bug: please report it)",
    USAGE: "bad command line: an unknown flag or value, no prompt (none given, or empty), a socket that is not a "
           "filesystem path, the target of `demo-model` or `convert` exists, a group size that does not divide the "
           "matrices, a source that is already a container",
    MODEL: "the model is unusable: missing directory, no `config.json`, unknown `model_type` (the message lists the "
           "supported ones), a malformed or truncated safetensors file, a missing tensor or one of the wrong shape, "
           "a container's dense file that fails its checksum, no tokenizer, no chat template, int8 activations asked "
           "of experts that are not int8 or int4; an expert that cannot be read (MODEL_ERROR)",
    BAD_REQUEST: "the request cannot run as asked: input that is not UTF-8, invalid sampling values, a prompt longer "
                 "than the model's context or larger than the daemon takes, an expert budget that is unreadable, "
                 "below the minimum or above this box's RAM (or given for a checkpoint rather than a container), an "
                 "unknown expert or one not pinned, a session of another model or of the other kind (chat or text), "
                 "a session name that is not valid, a routing trace that is not one (convert, plan and tune "
                 "--trace), a `--memory` the model cannot run in (tune: nothing written)",
    DAEMON_DOWN: "no daemon answers: no socket, a stale socket, or the daemon stopped answering mid-request",
    BUSY: "the daemon is busy (its queue is full) or stopping, also when it stops in the middle of a request: "
          "retry later",
    CHECK_FAILED: "`colictl doctor`: a check failed; `colictl drives stage` or `verify`: a copy of the expert files "
                  "does not match the container (or the directory holds another container's copies)",
    PERMISSION: "this user may not use the socket (user or operator)",
    LOADING: "the daemon is still loading its model (`colictl status` shows the phase; `generate --wait` waits)",
    INTERRUPTED: "interrupted (Ctrl-C), or the request was cancelled",
}

# protocol error names (daemon/protocol.py ERRORS) -> exit codes
FROM_ERROR = {"BAD_MESSAGE": BAD_REQUEST, "UNKNOWN_TYPE": BAD_REQUEST, "VERSION_MISMATCH": BAD_REQUEST,
              "INVALID_REQUEST": BAD_REQUEST, "NOT_FOUND": BAD_REQUEST, "BUSY": BUSY, "CANCELLED": INTERRUPTED,
              "SHUTTING_DOWN": BUSY, "MODEL_ERROR": MODEL, "INTERNAL": INTERNAL, "TOO_LARGE": BAD_REQUEST,
              "FORBIDDEN": PERMISSION, "LOADING": LOADING}


def markdown() -> str:
    """The exit-code table as the README shows it."""
    rows = [f"| {code} | {meaning} |" for code, meaning in MEANING.items()]
    return "\n".join(["| code | meaning |", "|---|---|", *rows])


def protocol_markdown() -> str:
    """Which exit code colictl gives for each protocol error, as docs/protocol.md shows it."""
    by_code: dict[int, list[str]] = {}
    for name, code in FROM_ERROR.items():
        by_code.setdefault(code, []).append(name)
    rows = [f"| {code} | {', '.join(names)} |" for code, names in sorted(by_code.items())]
    return "\n".join(["| exit code | protocol errors |", "|---|---|", *rows])
