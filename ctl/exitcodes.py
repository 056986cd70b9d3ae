"""colictl's exit codes, one per kind of failure a shell script may want to tell apart."""

OK = 0
INTERNAL = 1  # a bug: please report it
USAGE = 2  # bad command line (click's own code)
MODEL = 3  # the model directory or a file in it is unusable
BAD_REQUEST = 4  # the request cannot be run as asked (sampling values, prompt too long, ...)
DAEMON_DOWN = 5  # no daemon answers on the socket
BUSY = 6  # the daemon is busy or stopping: retry later
CHECK_FAILED = 7  # colictl doctor: a check failed
PERMISSION = 8  # this user may not use the socket (user or operator)
INTERRUPTED = 130  # Ctrl-C

# protocol error names (daemon/protocol.py ERRORS) -> exit codes
FROM_ERROR = {"BAD_MESSAGE": BAD_REQUEST, "UNKNOWN_TYPE": BAD_REQUEST, "VERSION_MISMATCH": BAD_REQUEST,
              "INVALID_REQUEST": BAD_REQUEST, "NOT_FOUND": BAD_REQUEST, "BUSY": BUSY, "SHUTTING_DOWN": BUSY,
              "MODEL_ERROR": MODEL, "CANCELLED": INTERRUPTED, "TOO_LARGE": BAD_REQUEST, "FORBIDDEN": PERMISSION}
