"""colibrid: the command line of the daemon (runs in the foreground; systemd or a shell
supervises it)."""

import logging
import os
import sys

import click

from ..storage.errors import ColibriError

EXIT_CONFIG = 2  # a bad configuration or flag
EXIT_START = 3  # the model or the socket could not be set up


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


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--config", "config_path", metavar="PATH", help="YAML configuration (etc/colibri.yaml documents it)")
@click.option("--model", metavar="DIR", help="model directory (overrides the file)")
@click.option("--socket", "socket_path", metavar="PATH", help="socket path (overrides the file)")
@click.option("--expert-cache", metavar="SIZE", help="expert cache budget (overrides the file)")
@click.option("--print-config", is_flag=True, help="print the effective configuration and exit")
@click.version_option(package_name="colibri", prog_name="colibrid")
def main(config_path, model, socket_path, expert_cache, print_config):
    """Serve a Mixture-of-Experts model to colictl clients over a local socket."""
    for var, val in {"OPENBLAS_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE",
                     "TOKENIZERS_PARALLELISM": "false"}.items():
        os.environ.setdefault(var, val)
    from . import config as C

    overrides = {"model": model, "socket": socket_path, "expert_cache": expert_cache}
    try:
        cfg = C.load(config_path, overrides)
    except C.ConfigError as e:
        click.echo(f"colibrid: {e}", err=True)
        raise SystemExit(EXIT_CONFIG) from None
    if print_config:
        import yaml

        click.echo(yaml.safe_dump(cfg.as_dict(), sort_keys=False), nl=False)
        return
    setup_logging(cfg.log_level)
    from .server import Server

    try:
        code = Server(cfg, config_path, overrides).run()
    except ColibriError as e:
        click.echo(f"colibrid: {e}", err=True)
        raise SystemExit(EXIT_START) from None
    except OSError as e:
        click.echo(f"colibrid: {e.strerror or e}{': ' + str(e.filename) if e.filename else ''}", err=True)
        raise SystemExit(EXIT_START) from None
    raise SystemExit(code)
