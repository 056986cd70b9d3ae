"""colibrid: the command line of the daemon (runs in the foreground; systemd or a shell
supervises it)."""

import logging
import os

import click

from ..storage.errors import ColibriError
from .logs import setup_logging

EXIT_CONFIG = 2  # a bad configuration or flag
EXIT_START = 3  # the model or the socket could not be set up
EXIT_INTERNAL = 1  # a bug


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--config", "config_path", metavar="PATH", help="YAML configuration (etc/colibri.yaml documents it)")
@click.option("--model", metavar="DIR", help="model directory (overrides the file)")
@click.option("--socket", "socket_path", metavar="PATH", help="user socket path (overrides the file)")
@click.option("--operator-socket", "operator_path", metavar="PATH",
              help="operator socket path (overrides the file; default: colibri-operator.sock next to the user socket)")
@click.option("--expert-cache", metavar="SIZE", help="expert cache budget (overrides the file)")
@click.option("--print-config", is_flag=True, help="print the effective configuration, defaults resolved, and exit")
@click.option("--compile-only", is_flag=True, help="compile the kernels into numba's cache (keyed by the source and "
                                                    "the CPU) and exit; setup.sh runs it so a first start is fast")
@click.version_option(package_name="colibri", prog_name="colibrid")
def main(config_path, model, socket_path, operator_path, expert_cache, print_config, compile_only):
    """Serve a Mixture-of-Experts model to colictl clients over a local socket."""
    for var, val in {"OPENBLAS_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE",
                     "TOKENIZERS_PARALLELISM": "false"}.items():
        os.environ.setdefault(var, val)
    from . import config as C

    overrides = {"model": model, "socket": socket_path, "operator_socket": operator_path, "expert_cache": expert_cache}
    try:
        cfg = C.load(config_path, overrides)
    except C.ConfigError as e:
        click.echo(f"colibrid: {e}", err=True)
        raise SystemExit(EXIT_CONFIG) from None
    if print_config:
        import yaml

        click.echo(yaml.safe_dump(C.resolved(cfg), sort_keys=False), nl=False)
        return
    setup_logging(cfg.log_level)
    if compile_only:
        raise SystemExit(compile_kernels())
    from .server import Server

    try:
        code = Server(cfg, config_path, overrides).run()
    except ColibriError as e:
        click.echo(f"colibrid: {e}", err=True)
        raise SystemExit(EXIT_START) from None
    except OSError as e:
        click.echo(f"colibrid: {e.strerror or e}{': ' + str(e.filename) if e.filename else ''}", err=True)
        raise SystemExit(EXIT_START) from None
    except Exception as e:  # a bug: one line for the user, the traceback in the log at debug level
        logging.getLogger("colibri.daemon").debug("start-up failed", exc_info=True)
        click.echo(f"colibrid: internal error: {type(e).__name__}: {e} (a bug: please report it; "
                   "log_level: debug shows where)", err=True)
        raise SystemExit(EXIT_INTERNAL) from None
    raise SystemExit(code)


def compile_kernels() -> int:
    """Compile (or load from numba's cache) every kernel, reporting each group."""
    import time

    from ..engine import layers

    log = logging.getLogger("colibri.daemon")
    t0 = time.perf_counter()
    layers.init(1, lambda phase, done, total: log.info("%s: %d/%d", phase, done + 1, total))
    log.info("kernels ready in %.1f s", time.perf_counter() - t0)
    return 0
