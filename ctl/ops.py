"""colictl's operator commands, on the operator socket: cache (show, set), pin, unpin, policy
(show, set), reload, kept (list, drop) and shutdown. Registered on colictl in main.py (COMMANDS)."""

import json

import click

from . import exitcodes
from .connect import fail, with_client
from .lines import history_line, kv_line, tables_line
from .options import text_arg


@click.group()
def cache():
    """Show or resize the expert cache of the running daemon."""


def show_placement(r: dict) -> None:
    p, e = r["placement"], r["experts"]
    if r.get("kv"):
        click.echo(kv_line(r["kv"]))
    if r.get("tables"):
        click.echo(tables_line(r["tables"]))
    if "slots" not in p:
        click.echo(f"experts all resident ({p.get('expert_bytes', 0) / 2**20:.1f} MiB)")
        return
    click.echo(f"budget {p['budget_bytes'] / 2**20:.1f} MiB ({p['pinned_bytes'] / 2**20:.1f} MiB pinned: "
               f"{' '.join(p['pinned']) or 'none'}): arena {p['arena_bytes'] / 2**20:.1f} MiB, "
               f"{p['slots_per_layer']} slots per layer of {p['record_bytes'] / 2**10:.0f} KiB, "
               f"{'O_DIRECT' if p['o_direct'] else 'buffered'} reads, {p['io_threads']} I/O threads, "
               f"mlock: {p['mlock']}, hugepages: {p['hugepages']}")
    rate = f"{100 * e['hit_rate']:.1f} %" if e["hit_rate"] is not None else "-"
    click.echo(f"hits {e['hits']}, misses {e['misses']} (hit rate {rate}), evictions {e['evictions']}")
    if "policy" in p:
        click.echo(f"policy {p['policy']['name']}: {p['learned_pins']} learned pins, pinned part sized by "
                   f"{p['pinned_size_by']}, {e.get('repins', 0)} repins")


@cache.command("show")
@click.option("--json", "as_json", is_flag=True, help="one JSON object: placement and counters")
@with_client(operator=True)
def cache_show(client, as_json):
    """The budget, the arena and the counters."""
    r = client.call("cache", action="show")
    if as_json:
        click.echo(json.dumps({"placement": r["placement"], "experts": r["experts"], "kv": r.get("kv"),
                               "tables": r.get("tables")}))
    else:
        show_placement(r)


def persist_option(fn):
    return click.option("--persist", is_flag=True,
                        help="keep the change for the next start (the daemon's STATE_DIR/runtime.yaml)")(fn)


def say_kept(r: dict, persist: bool) -> None:
    """On stderr: whether a runtime change outlives a restart."""
    if r.get("persisted"):
        click.echo(f"[colibri] kept for the next start in {r['persisted']}", err=True)
    elif persist and r.get("persist_error"):
        click.echo(f"colictl: applied, but NOT kept for the next start: {r['persist_error']}", err=True)
    elif not persist:
        click.echo("[colibri] applied until the daemon restarts (--persist keeps it)", err=True)


@cache.command("set")
@click.option("--experts", "size", metavar="SIZE", help="the expert cache: bytes, KiB/MiB/GiB, min or all")
@click.option("--pinned", metavar="SIZE", help="the part of it for pinned experts; auto: what the policy's hot "
                                             "set takes (default: unchanged)")
@click.option("--kv", metavar="SIZE", help="the prefix cache (KV blocks of computed prompts): bytes, KiB/MiB/GiB; "
                                         "0: off")
@click.option("--tables", metavar="SIZE", help="the streamed embedding tables' cache (Qwen4-Exp's n-gram tables): "
                                             "bytes, KiB/MiB/GiB or min")
@persist_option
@with_client(operator=True)
def cache_set(client, size, pinned, kv, tables, persist):
    """Resize the expert cache, the prefix cache or the embedding tables' cache now: no
    restart, no request dropped. Lost at a restart unless --persist."""
    if size is None and kv is None and tables is None:
        fail("cache set needs --experts SIZE, --kv SIZE or --tables SIZE", exitcodes.USAGE)
    if pinned is not None and size is None:
        fail("--pinned is the part of --experts: give both", exitcodes.USAGE)
    fields = {k: v for k, v in (("experts", size), ("pinned", pinned), ("kv", kv), ("tables", tables)) if v is not None}
    r = client.call("cache", timeout_ms=None, action="set", persist=persist, **fields)
    show_placement(r)
    say_kept(r, persist)


def expert_ref(value: str) -> tuple[int, int]:
    try:
        layer, expert = (int(v) for v in value.split(":"))
        return layer, expert
    except ValueError:
        raise click.BadParameter(f"{value!r} is not LAYER:EXPERT, e.g. 3:17") from None


def pin_command(kind: str, doc: str):
    @click.command(kind, help=doc)
    @click.argument("ref", metavar="LAYER:EXPERT")
    @with_client(operator=True)
    def command(client, ref):
        il, ie = expert_ref(ref)
        r = client.call(kind, timeout_ms=None, layer=il, expert=ie)
        click.echo(f"pinned: {' '.join(r['pinned']) or 'none'}")

    return command


pin = pin_command("pin", "Keep an expert in RAM until unpinned (it uses the cache's pinned part).")


unpin = pin_command("unpin", "Let a pinned expert be evicted again.")


@click.group()
def policy():
    """Show or change the expert cache policy of the running daemon."""


def show_policy(r: dict) -> None:
    if r["history"] is None:
        click.echo("policy  none: every expert is resident (a checkpoint); convert it to a container to stream "
                   "experts under a policy")
        return
    click.echo("policy  " + ", ".join(f"{k}={v}" for k, v in r["policy"].items()))
    click.echo(f"history {history_line(r['history'])}")


@policy.command("show")
@click.option("--json", "as_json", is_flag=True, help="one JSON object: the policy and the usage history")
@with_client(operator=True)
def policy_show(client, as_json):
    """The policy in use and its usage history."""
    r = client.call("policy", action="show")
    if as_json:
        click.echo(json.dumps({"policy": r["policy"], "history": r["history"]}))
    else:
        show_policy(r)


@policy.command("set")
@click.argument("settings", nargs=-1, required=True, metavar="KEY=VALUE...")
@persist_option
@with_client(operator=True)
def policy_set(client, settings, persist):
    """Change the policy between two steps, e.g. `policy=lru`, `prefetch_reads=8`,
    `hot_set=0.3`, `repin_every=64`, `repin_margin=0.5`. Lost at a restart unless
    --persist."""
    fields = {}
    for s in settings:
        key, eq, value = text_arg(s, "strict", "a setting").partition("=")
        if not eq or not key:
            fail(f"{s!r} is not KEY=VALUE", exitcodes.USAGE)
        fields[key.strip()] = value.strip()
    r = client.call("policy", timeout_ms=None, action="set", settings=fields, persist=persist)
    show_policy(r)
    say_kept(r, persist)


@click.command()
@with_client(operator=True)
def reload(client):
    """Re-read the daemon's configuration and apply what can change while it runs."""
    r = client.call("reload")
    click.echo(f"applied: {', '.join(r['applied']) or 'nothing'}; needs a restart: "
               f"{', '.join(r['restart_needed']) or 'nothing'}")


@click.group(invoke_without_command=True)
@click.option("--json", "as_json", is_flag=True, help="one JSON object")
@click.pass_context
def kept(ctx, as_json):
    """The settings kept with --persist (every model's; the running model's apply at its
    starts unless a flag or a later edit of the configuration sets the key)."""
    if ctx.invoked_subcommand is not None:
        return
    kept_list(as_json)


@with_client(operator=True)
def kept_list(client, as_json):
    r = client.call("kept", action="list")
    if as_json:
        click.echo(json.dumps({"kept": r["kept"], "file": r["file"]}))
        return
    if not r["kept"]:
        click.echo(f"nothing kept ({r['file']})")
    for k in r["kept"]:
        whose = "this model" if k["this_model"] else f"another model ({k['model']}, {k['fingerprint']})"
        click.echo(f"{k['key']:<15} {k['value']!s:<12} kept by `{k['by']}` at {k['at']}, for {whose}")


@kept.command("drop")
@click.argument("keys", nargs=-1, metavar="[KEY...]")
@click.option("--all-models", is_flag=True, help="drop them for every model, not only the running one")
@with_client(operator=True)
def kept_drop(client, keys, all_models):
    """Drop kept values (every key without KEY): the next start, or a reload, takes the
    configuration's value again."""
    r = client.call("kept", action="drop", keys=list(keys) or None, all_models=all_models)
    if not r["dropped"]:
        fail(f"nothing kept for {', '.join(keys) if keys else 'this model'} ({r['file']})", exitcodes.BAD_REQUEST)
    for g in r["dropped"]:
        click.echo(f"dropped {g['key']} {g['value']} (model {g['model']})")
    click.echo("[colibri] the running values stay until a reload or a restart takes the configuration's", err=True)


@click.command()
@with_client(operator=True)
def shutdown(client):
    """Stop the daemon (it cancels running requests and exits)."""
    client.call("shutdown")
    click.echo("colibrid is stopping", err=True)


COMMANDS = (cache, pin, unpin, policy, reload, kept, shutdown)
