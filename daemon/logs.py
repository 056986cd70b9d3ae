"""colibrid's logging: to the journal under systemd, to stderr otherwise. Its own module so
that the command line (main.py) and the server (reload sets the level) share it without
importing each other."""

import logging
import os
import sys


def setup_logging(level: str) -> None:
    """To the journal under systemd, to stderr otherwise."""
    handler: logging.Handler
    if os.environ.get("JOURNAL_STREAM") or os.environ.get("INVOCATION_ID"):
        try:
            from systemd.journal import JournalHandler

            handler = JournalHandler(SYSLOG_IDENTIFIER="colibrid")
        except ImportError:
            handler = logging.StreamHandler(sys.stderr)
    else:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("colibrid: %(levelname)s %(message)s"))
    root = logging.getLogger("colibri")
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
