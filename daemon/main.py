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


@click.group(invoke_without_command=True, context_settings={"help_option_names": ["-h", "--help"]})
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
@click.pass_context
def main(ctx, config_path, model, socket_path, operator_path, expert_cache, print_config, compile_only):
    """Serve a Mixture-of-Experts model to colictl clients over a local socket (or, with
    a command, do one boot-time job and exit)."""
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
    if ctx.invoked_subcommand is not None:
        ctx.obj = cfg
        return
    if print_config:
        click.echo(print_config_text(config_path, overrides), nl=False)
        return
    setup_logging(cfg.log_level)
    if compile_only:
        raise SystemExit(compile_kernels())
    from .server import Server

    try:
        code = Server(cfg, config_path, overrides).run()
    except (ColibriError, OSError) as e:
        from .notify import notify

        text = str(e) if isinstance(e, ColibriError) else \
            f"{e.strerror or e}{': ' + str(e.filename) if e.filename else ''}"
        notify(f"STATUS=cannot start: {text}")  # (systemd shows it beside the exit status)
        click.echo(f"colibrid: {text}", err=True)
        raise SystemExit(EXIT_START) from None
    except Exception as e:  # a bug: one line for the user, the traceback in the log at debug level
        logging.getLogger("colibri.daemon").debug("start-up failed", exc_info=True)
        click.echo(f"colibrid: internal error: {type(e).__name__}: {e} (a bug: please report it; "
                   "log_level: debug shows where)", err=True)
        raise SystemExit(EXIT_INTERNAL) from None
    raise SystemExit(code)


def print_config_text(config_path: str | None, overrides: dict) -> str:
    """The effective configuration as YAML, defaults resolved and this model's kept values
    applied, each key with its origin (a file or fragment, the command line, runtime.yaml,
    or the default). Raises ConfigError."""
    import yaml

    from . import config as C
    from . import kept
    from .protocol import kept_note

    cfg = C.load(config_path, overrides)
    model = C.resolved(cfg)["model"]
    cfg, notes = kept.effective(config_path, overrides, kept.model_fingerprint(model))
    where = kept.origins(config_path, overrides, notes, cfg.state_dir)
    lines = [f"# {kept_note(n)}\n" for n in notes]
    for key, value in C.resolved(cfg).items():
        text = yaml.safe_dump({key: value}, sort_keys=False, default_flow_style=False, width=1 << 16)
        first, _, rest = text.partition("\n")
        lines.append(f"{first}  # {where[key]}\n{rest}")
    return "".join(lines)


@main.command("drives")
@click.option("--json", "as_json", is_flag=True, help="print the report as one JSON object")
@click.pass_obj
def drives(cfg, as_json):
    """Set the expert drives up for colibri's reads (with tune_drives: true; else report
    what it would change) and exit. The unit runs it privileged before the daemon
    (ExecStartPre=+), which may not write /sys itself; `colictl status` shows the result."""
    import json

    from .boot import drives_report_path, prepare_drives, set_cpus, set_numa
    from .config import resolved, state_dir

    setup_logging(cfg.log_level)
    set_cpus(cfg.cpus)  # the CPUs the daemon will run on: its drives' interrupts go there
    set_numa(cfg.numa_node)
    model = resolved(cfg)["model"]
    while not os.path.exists(model) and os.path.dirname(model) != model:
        model = os.path.dirname(model)  # (the demo model is written at the first start: its drive is the state's)
    report = drives_report_path(state_dir(cfg))
    try:
        got = prepare_drives([model, *cfg.drives], sorted(os.sched_getaffinity(0)), cfg.tune_drives, report)
    except OSError as e:
        click.echo(f"colibrid: cannot write {report}: {e.strerror}", err=True)
        raise SystemExit(EXIT_START) from None
    if as_json:
        click.echo(json.dumps(got))
        return
    for d in got:
        steps = d.get("changed", d.get("would_change", []))
        done = [f"{s['what']} {s['from']} -> {s['to']}" + ("" if s.get("done", True) else f" (not done: {s['why']})")
                for s in steps]
        verb = "set" if cfg.tune_drives else "would set (tune_drives is off)"
        click.echo(f"colibrid: drive {d.get('device') or 'none'} under {d['path']}: "
                   + (f"{verb} " + ", ".join(done) if done else "nothing to change"), err=True)


def compile_kernels() -> int:
    """Compile (or load from numba's cache) every kernel, reporting each group."""
    import time

    from ..engine import layers

    log = logging.getLogger("colibri.daemon")
    t0 = time.perf_counter()
    log.info("compiling the kernels for this CPU into numba's cache: 4-5 minutes on 2 cores the first time, "
             "seconds once cached")

    def progress(phase, done, total):  # seconds spent, and expected in all (engine/jit.py's Ticker)
        if done == 0:
            return
        log.info("%s: %d%% in %d s, about %d s left", phase, 100 * done // total, done, total - done)

    layers.init(1, progress)
    log.info("kernels ready in %.1f s", time.perf_counter() - t0)
    return 0
