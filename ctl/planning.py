"""`colictl plan` and `colictl tune`: what a model will do on this box (the drives, memory
and a decode step measured, daemon/planner.py), and the settings that follow, written as a
configuration fragment only when colibrid would start with it. Offline commands: the
engine is imported when they run."""

import json
import os
import sys

import click

from . import exitcodes
from .offline import fmt_bytes, guarded, resolve_model
from .options import model_argument


def plan_options(fn):
    """The options plan and tune share."""
    for opt in reversed([
        model_argument("a container, a GGUF file or a Hugging Face checkpoint (default: the built-in demo model)"),
        click.option("--memory", metavar="SIZE", help="RAM the model may use: bytes, KiB/MiB/GiB, all (this box's) or min (the least "
                                                           "it runs in); default: what is available now"),
        click.option("--trace", "trace_path", type=click.Path(exists=True, dir_okay=False), metavar="FILE",
                     help="a routing trace of the expected work (colictl run --routing-trace) for the hit rates "
                          "(default: the daemon's usage history of a container, else uniform routing)"),
        click.option("--drive", "drives", multiple=True, type=click.Path(file_okay=False, exists=True), metavar="DIR",
                     help="a copy of the expert files on another drive, measured too (repeatable)"),
        click.option("--config", "config_path", type=click.Path(dir_okay=False), metavar="FILE",
                     help="colibrid's configuration: its state_dir (usage history) and drives"),
        click.option("--threads", type=click.IntRange(0, 1024), default=0, help="threads computing (0: all)"),
    ]):
        fn = opt(fn)
    return fn


def memory_arg(text: str | None, path: str) -> int | None:
    """--memory in the grammar every command takes a memory size in (run's --expert-cache,
    colibrid's budgets): bytes or KiB/MiB/GiB, `all` (this box's RAM) or `min` (the least
    the model runs in: its minimum budgets, the prefix cache off); None: what is available
    now. Checked before anything is measured: a size above this box's RAM is refused as
    run refuses it, and so is one below the model's floor (a container's or a GGUF file's:
    a checkpoint's depends on the precision it will be converted to).
    Raises BudgetInvalid."""
    from ..engine.registry import build_model
    from ..storage.errors import BudgetInvalid
    from ..storage.memory import ram_bytes
    from ..storage.placement import check_budgets
    from ..storage.sizes import parse_size

    if text is None:
        return None
    asked = parse_size(text)
    if asked == "all":
        return ram_bytes()
    if isinstance(asked, int) and asked > ram_bytes():
        raise BudgetInvalid(f"--memory {text} is above this box's RAM of {fmt_bytes(ram_bytes())} "
                            f"({ram_bytes()} bytes): plan for all of it (--memory all) or less")
    try:
        floor = check_budgets(path, "min", 0, build_model, "min")
    except BudgetInvalid:  # (a checkpoint: every expert resident until it is converted)
        if asked == "min":
            raise BudgetInvalid(f"--memory min needs a container or a GGUF file: {path} is a checkpoint, whose "
                                   "smallest memory depends on the precision it is converted to") from None
        return asked
    if asked == "min":
        return floor.total_bytes
    if asked < floor.total_bytes:
        raise BudgetInvalid(f"--memory {text} is {fmt_bytes(floor.total_bytes - asked)} short: the model needs at "
                            f"least {floor.text()} at its minimum budgets (--memory min); nothing measured, nothing "
                            "written")
    return asked


def plan_for(model_path, memory, trace_path, drives, config_path, threads, precisions=None) -> dict:
    from ..daemon.config import load, state_dir
    from ..daemon.planner import make_plan
    from ..engine.registry import build_model
    from ..storage.sizes import parse_size

    cfg = load(config_path)
    path = resolve_model(model_path or cfg.model)
    mem = memory_arg(memory, path)
    say = (lambda m: click.echo(f"colictl: plan: {m}", err=True)) if sys.stderr.isatty() else (lambda m: None)
    return make_plan(path, build_model, memory=mem, trace=trace_path,
                     drives=tuple(drives) + tuple(cfg.drives), state_dir=state_dir(cfg), precisions=precisions,
                     threads=threads or None, kv_bytes=parse_size(cfg.kv_cache), say=say)


def show_plan(p: dict) -> None:
    s = p["shape"]
    click.echo(f"model   {p['model_type']} at {p['model']}: {s['moe_layers']} MoE layers x {s['n_expert']} experts, "
               f"top-{s['top_k']}; dense {fmt_bytes(p['dense_bytes'])}"
               + (f", embedding tables {fmt_bytes(p['table_bytes'])} (streamed)" if p.get("table_bytes") else ""))
    click.echo(f"box     {p['threads']} compute threads, memory {p['memory_gbs']:.1f} GB/s a core, "
               f"{fmt_bytes(p['memory_bytes'])} for the model")
    for d in p["drives"]:
        click.echo(f"drive   {d['drive']}: {d['gbs']:.2f} GB/s {'O_DIRECT' if d['o_direct'] else 'buffered'} in "
                   f"{fmt_bytes(d['block_bytes'])} reads (p50 {d['latency_ms_p50']:.1f} ms, p99 "
                   f"{d['latency_ms_p99']:.1f} ms); {d['io_threads']} thread(s) reach it")
    r = p["routing"]
    click.echo(f"routing {dict(trace='from the trace', history='from the usage history', uniform='uniform (no trace or history)')[r['source']]}, "
               f"{r['waste']:.2f} lookahead reads a layer not used")
    click.echo(f"{'precision':<10} {'record':>10} {'budget':>18} {'hit':>6} {'read/token':>11} {'disk s':>8} "
               f"{'compute s':>9} {'tok/s':>7}  bound")
    for prec, row in p["precisions"].items():
        lines = row["table"] + ([row["at_fit"] | {"budget_fraction": row["fit_fraction"], "fit": True}]
                                if row["fit_fraction"] < 1 else [])
        for t in lines:
            budget = f"{100 * t['budget_fraction']:.0f} % {fmt_bytes(t['budget_bytes'])}" + (" *" if t.get("fit") else "")
            click.echo(f"{prec + (' (lossy)' if row['lossy'] else ''):<10} {fmt_bytes(row['record_bytes']):>10} "
                       f"{budget:>18} {t['hit_rate']:>6.2f} {fmt_bytes(t['bytes_read_per_token']):>11} "
                       f"{t['disk_s']:>8.4f} {t['compute_s']:>9.4f} {t['tok_s']:>7.1f}  {t['bound']}")
    rec = p["recommend"]
    if not rec["fits"]:  # (no settings to recommend: none of them runs)
        click.echo(f"does not fit: {rec['why']}")
        return
    click.echo(f"recommended: expert_cache: {rec['expert_cache']}"
               + (f", kv_cache: {rec['kv_cache']}" if "kv_cache" in rec else "")
               + (f", table_cache: {rec['table_cache']}" if "table_cache" in rec else "") + f", io_threads: {rec['io_threads']}"
               + (f", reader: {rec['reader']}" if "reader" in rec else "")
               + f", precision {rec['precision']} (the model's own): {rec['predicted_tok_s']} tok/s, "
                 f"{rec['bound']}-bound" + (" (* = what fits in memory)" if any(
                     r["fit_fraction"] < 1 for r in p["precisions"].values()) else ""))
    if "lossy_option" in rec:
        o = rec["lossy_option"]
        click.echo(f"faster, and lossy: {o['precision']} at {o['predicted_tok_s']} tok/s ({o['how']})")


@click.command()
@plan_options
@click.option("--dtype", "precisions", multiple=True, type=click.Choice(["bf16", "int8", "int4"]),
              help="of a checkpoint, the expert precisions to time (default: its own, and int8/int4 for a float one)")
@click.option("--json", "as_json", is_flag=True, help="one JSON object")
@guarded
def plan(model_path, memory, trace_path, drives, config_path, threads, precisions, as_json):
    """What the model will do on this box: the drives, memory and a decode step measured,
    and per precision and expert budget the bytes read per token and the tok/s the slower
    of disk and compute allows; then the settings to use. Works on a checkpoint before it
    is converted."""
    p = plan_for(model_path, memory, trace_path, drives, config_path, threads, tuple(precisions) or None)
    if as_json:
        click.echo(json.dumps(p))
    else:
        show_plan(p)
    if not p["recommend"]["fits"]:
        raise SystemExit(exitcodes.BAD_REQUEST)


def write_checked_fragment(out: str, text: str, config_path: str | None, model: str) -> None:
    """Write a configuration fragment only if the daemon would start with it: the whole
    configuration loaded with it in place (the daemon's own validation: every key, every
    fragment) and its budgets checked against the model (the minimum, this box's RAM) as
    placing the model checks them. Written beside `out` and renamed over it, so a daemon
    never reads half a file. Raises ConfigError, BudgetInvalid (nothing written)."""
    from ..daemon.config import load
    from ..engine.registry import build_model
    from ..storage.placement import check_budgets
    from ..storage.sizes import parse_size

    out = os.path.abspath(out)
    os.makedirs(os.path.dirname(out), exist_ok=True)
    tmp = os.path.join(os.path.dirname(out), f".{os.path.basename(out)}.tmp")  # (not *.yaml: never read as one)
    with open(tmp, "w") as f:
        f.write(text)
    try:
        # the configuration as the daemon will read it, with this fragment in its place
        cfg = load(config_path, fragment=(out, tmp)) if config_path else load(tmp)
        check_budgets(model, parse_size(cfg.expert_cache), parse_size(cfg.kv_cache), build_model, cfg.table_budget())
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@click.command()
@plan_options
@click.option("--write", "out", type=click.Path(dir_okay=False), metavar="FILE",
              help="the configuration fragment to write (default: CONFIG.d/50-tune.yaml with --config, else stdout)")
@guarded
def tune(model_path, memory, trace_path, drives, config_path, threads, out):
    """Run plan's measurements for a container and write the settings it recommends as a
    configuration fragment colibrid reads after its configuration file; keep the plan in
    the state directory, so that `colictl stats` shows predicted against measured tok/s."""
    from ..daemon.config import load, state_dir
    from ..daemon.planner import plan_path
    from ..storage.container import is_container
    from ..storage.errors import BudgetInvalid

    cfg = load(config_path)
    p = plan_for(model_path, memory, trace_path, drives, config_path, threads)
    rec = p["recommend"]
    if not rec["fits"]:
        raise BudgetInvalid(f"nothing written: {rec['why']}")
    keys = {k: rec[k] for k in ("expert_cache", "kv_cache", "table_cache", "io_threads", "reader") if k in rec}
    text = "".join([f"# colictl tune, {p['made']}: {p['model']}\n",
                    f"# predicted {rec['predicted_tok_s']} tok/s ({rec['bound']}-bound), drives "
                    + ", ".join(f"{d['gbs']:.2f} GB/s" for d in p["drives"]) + "\n",
                    *(f"{k}: {v}\n" for k, v in keys.items())])
    out = out or (config_path + ".d/50-tune.yaml" if config_path else None)
    if out:
        write_checked_fragment(out, text, config_path, p["model"])
        click.echo(f"[colibri] wrote {out}: " + ", ".join(f"{k}: {v}" for k, v in keys.items()), err=True)
    else:
        click.echo(text, nl=False)
    if p["container"] and is_container(p["model"]):
        where = plan_path(state_dir(cfg), p["container"])
        try:
            os.makedirs(os.path.dirname(where), exist_ok=True)
            with open(where + ".tmp", "w") as f:
                json.dump(p, f)
            os.replace(where + ".tmp", where)
            click.echo(f"[colibri] the plan is in {where}: colictl stats compares it with what colibrid measures",
                       err=True)
        except OSError as e:
            click.echo(f"colictl: cannot keep the plan in {where} ({e.strerror}): run tune as the daemon's user",
                       err=True)
