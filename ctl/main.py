"""colictl: the command line. Client commands talk to colibrid through ctl/client.py and import
nothing heavy: generate, chat, session, status, stats, ping, drives status on the user
socket here; cache, pin, unpin, policy, reload, kept, shutdown on the operator socket in
ops.py; connect.py how a command reaches the daemon, lines.py how its reports print. The
commands that need no daemon (run, convert, demo-model in ctl/offline.py, plan and tune in
ctl/planning.py, doctor in ctl/doctor.py) are imported only when called, so the client
path never loads numpy or numba."""

import json
import sys
import time

import click

from ..daemon.protocol import kept_note, precision_text
from . import exitcodes, ops
from .connect import fail, with_client
from .lines import (
    boot_drive_line,
    boot_line,
    drive_line,
    history_line,
    kv_line,
    phase_line,
    plan_line,
    session_line,
    tables_line,
)
from .options import (
    BadInput,
    input_errors_option,
    read_prompt,
    sampling_fields,
    sampling_options,
    text_arg,
)


class LazyGroup(click.Group):
    """A group whose offline commands are imported when used, not at start."""

    LAZY = {"run": ("offline", "run"), "demo-model": ("offline", "demo_model"), "convert": ("offline", "convert"),
            "doctor": ("doctor", "doctor"), "plan": ("planning", "plan"),
            "tune": ("planning", "tune")}  # name -> (module, command)

    def list_commands(self, ctx):
        return sorted(set(super().list_commands(ctx)) | set(self.LAZY))

    def get_command(self, ctx, name):
        if name in self.LAZY:
            import importlib

            module, attr = self.LAZY[name]
            return getattr(importlib.import_module(f"{__package__}.{module}"), attr)
        return super().get_command(ctx, name)


@click.group(cls=LazyGroup, invoke_without_command=True, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--socket", "socket_path", metavar="PATH", envvar="COLIBRI_SOCKET",
              help="colibrid's user socket (default: COLIBRI_SOCKET, else the runtime directory's)")
@click.option("--operator-socket", "operator_path", metavar="PATH", envvar="COLIBRI_OPERATOR_SOCKET",
              help="the operator socket, for cache, pin, policy, reload, shutdown (default: "
                   "COLIBRI_OPERATOR_SOCKET, else colibri-operator.sock next to the user socket)")
@click.version_option(package_name="colibri", prog_name="colictl")
@click.pass_context
def cli(ctx, socket_path, operator_path):
    """colibri: run Mixture-of-Experts models far larger than RAM."""
    ctx.obj = {"socket": socket_path, "operator": operator_path}
    if ctx.invoked_subcommand is None:  # bare colictl: the help, not an error
        click.echo(ctx.get_help())


@cli.command()
@click.option("--wait", is_flag=True, help="wait for colibrid to start (a minute at most for its socket)")
@with_client
def ping(client, wait):
    """Check that colibrid answers; prints the round trip. It answers while loading too."""
    t0 = time.perf_counter()
    client.call("ping")
    click.echo(f"pong from {client.path} in {(time.perf_counter() - t0) * 1e3:.2f} ms")


@cli.command()
@click.option("--json", "as_json", is_flag=True, help="one JSON object")
@with_client
def status(client, as_json):
    """The daemon, its model and what boot-time placement got."""
    r = client.call("status")
    if as_json:
        click.echo(json.dumps({k: v for k, v in r.items() if k not in ("type", "id", "v", "status")}))
        return
    click.echo(f"colibrid pid {r['pid']}, up {r['uptime_s']:.0f} s, socket {r['socket']}, {phase_line(r)}")
    m = r["model"]
    if m is not None:
        p = m["precision"]
        click.echo(f"model     {m['type']} at {m['path']}: {m['n_layer']} layers, {m['n_expert']} experts, "
                   f"{precision_text(p)}")
        pl = m["placement"]
        slots = pl.get("slots_per_layer")
        click.echo(f"experts   {pl.get('placement')}" + (
            f", {slots} slot{'s' if slots != 1 else ''} per layer, "
            f"{'O_DIRECT' if pl['o_direct'] else 'buffered'} reads by {pl.get('reader', 'preadv')}"
            + (f" ({pl['reader_note']})" if pl.get("reader_note") else "")
            + ("" if pl.get("checksums", True) else ", no checksums (a GGUF file; colictl convert adds them)")
            if "slots" in pl else ""))
        for bad in pl.get("bad_experts") or []:
            click.echo(f"BAD       expert {bad}")
    for step, got in r["boot"].items():
        if step == "boxes":
            for b in got:
                click.echo(f"box {b['box']}{' (head)' if not b['box'] else ''}     " + (
                    f"{100 * b['experts_share']:.1f} % of the experts, {100 * b['traffic_share']:.1f} % of the "
                    f"traffic, drive {b['disk_gbs']} GB/s, {b['cache_slots']} cache slots a layer"
                    if b["in_use"] else f"OUT: {b.get('out_why')}"))
        elif step == "drives":
            for d in got:
                click.echo(f"drive     {boot_drive_line(d)}")
        else:
            click.echo(f"boot      {step}: {boot_line(got)}")
    click.echo(f"requests  {r['requests']['active']} running or queued")
    rt = r.get("runtime")
    if rt and rt["changed"]:
        kept = [f"{k}: {v}" for k, v in rt["changed"].items() if k in rt["kept"]]
        lost = [f"{k}: {v}" for k, v in rt["changed"].items() if k not in rt["kept"]]
        if kept:
            click.echo(f"runtime   {', '.join(kept)}: kept for the next start in {rt['kept_in']}")
        if lost:
            click.echo(f"runtime   {', '.join(lost)}: LOST at a restart (cache set / policy set --persist keeps "
                       "them)")
    if rt and rt["hand_pins"]:
        click.echo(f"runtime   pins {' '.join(rt['hand_pins'])}: LOST at a restart (pin them again after one)")
    for n in (rt or {}).get("kept_at_start") or []:
        click.echo(f"kept      {kept_note(n)}")
    if rt and rt.get("restart_needed"):
        click.echo(f"config    changed since the start, applied at the next one: {', '.join(rt['restart_needed'])}")


@cli.command()
@click.option("--json", "as_json", is_flag=True, help="one JSON object per sample")
@click.option("--watch", type=float, metavar="SECONDS", default=None, is_flag=False, flag_value=2.0,
              help="print again every SECONDS (default 2) until Ctrl-C")
@with_client
def stats(client, as_json, watch):
    """Expert cache and request counters."""
    while True:
        r = client.call("stats")
        if as_json:
            click.echo(json.dumps({k: r.get(k) for k in ("experts", "kv", "drives", "plan", "boxes", "requests",
                                                         "uptime_s", "policy", "history", "phase", "progress",
                                                         "experts_by_layer", "latency", "queue", "memory",
                                                         "tables")}))
        elif r.get("experts") is None:
            click.echo(f"colibrid is {phase_line(r)}")
        else:
            e, q = r["experts"], r["requests"]
            rate = f"{100 * e['hit_rate']:.1f} %" if e["hit_rate"] is not None else "-"
            click.echo(f"experts: {e['hits']} hits, {e['misses']} misses (hit rate {rate}), "
                       f"{e['bytes_read'] / 2**20:.1f} MiB read, {e['evictions']} evictions, "
                       f"batch-union saving x{e.get('union_saving') or 1:.2f}, waiting on I/O {e['io_wait_s']:.2f} s, policy {r.get('policy') or '-'} | requests: "
                       f"{q['served']} served, {q.get('rejected', 0)} rejected, {q['failed']} failed, {q['cancelled']} cancelled, "
                       f"{q['tokens']} tokens")
            if r.get("history"):
                click.echo(f"history: {history_line(r['history'])}")
            if r.get("kv"):
                click.echo(kv_line(r["kv"]))
            if r.get("tables"):  # a model's streamed embedding tables
                click.echo(tables_line(r["tables"]))
            if len(r.get("drives") or []) > 1:
                for d in r["drives"]:
                    click.echo(drive_line(d))
            if r.get("plan") and r["plan"].get("predicted"):
                click.echo(plan_line(r["plan"]))
        if not watch:
            return
        try:
            time.sleep(watch)
        except KeyboardInterrupt:
            return


@cli.command()
@sampling_options(max_tokens=512)
@click.option("--system", metavar="TEXT", help="a system message to start the conversation")
@click.option("--session", metavar="NAME", help="continue the named conversation colibrid keeps for you (it "
                                               "survives restarts); each turn sends only the new message")
@input_errors_option
@click.option("--wait", is_flag=True, help="wait for colibrid to start (a minute for its socket) and to load its "
                                         "model")
@with_client
def chat(client, max_tokens, temperature, top_k, top_p, seed, system, session, input_errors, wait):
    """Talk with the model: each line you type is a user message; the conversation is kept
    and formatted with the model's chat template. Ctrl-C stops a reply, Ctrl-D ends."""
    from .options import decode_text

    ready(client, wait)
    system = text_arg(system, input_errors, "--system")
    session = text_arg(session, "strict", "--session")
    messages = [{"role": "system", "content": system}] if system else []
    fields = sampling_fields(max_tokens, temperature, top_k, top_p, seed)
    tty = sys.stdin.isatty()
    if session is not None:  # the daemon keeps the conversation: send each turn's new messages only
        fields["session"] = session
        known = existing_session(client, session)
        if known is not None and system:
            fail(f"session {session!r} has started already: --system only begins a new one", exitcodes.USAGE)
        if known is not None and tty:
            click.echo(f"[colibri] session {session}: {turns(known['turns'])}, {known['tokens']} tokens so far",
                       err=True)
    n_line = 0
    while True:
        if tty:
            click.echo("> ", nl=False, err=True)
        raw = sys.stdin.buffer.readline()
        if not raw:
            return
        n_line += 1
        try:
            line = decode_text(raw, input_errors, f"line {n_line}")
        except BadInput as e:
            if not tty:
                raise
            click.echo(f"colictl: {e}", err=True)  # at a terminal: say so and let the user type again
            continue
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line.rstrip("\n")})
        rid = client.send("generate", messages=messages, **fields)
        try:
            msg = stream_reply(client, rid, show=True)
        except KeyboardInterrupt:
            client.send("cancel", target=rid)
            msg = stream_reply(client, rid, show=False)
        sys.stdout.write("\n")
        sys.stdout.flush()
        if msg.get("status") != "ok" and msg.get("error", {}).get("name") != "CANCELLED":
            from .client import ReplyError

            raise ReplyError(msg)
        if session is not None:
            messages = []  # the daemon keeps them (a cancelled turn is not kept)
        else:
            messages.append({"role": "assistant", "content": msg.get("text", "")})


def existing_session(client, name: str) -> dict | None:
    """The summary of this user's session `name`, None when it does not exist yet."""
    from .client import ReplyError

    try:
        return client.call("session", action="show", name=name)["session"]
    except ReplyError as e:
        if e.name == "NOT_FOUND":
            return None
        raise


def stream_reply(client, rid: str, show: bool) -> dict:
    """Print a generate request's stream (when show) and return its final reply. Waits as
    long as the daemon answers pings; raises DaemonDown when it stops answering."""
    def write(msg):
        if show and msg.get("text"):
            sys.stdout.write(msg["text"])
            sys.stdout.flush()

    return client.reply_to(rid, None, stream=write)


def ready(client, wait: bool) -> dict:
    """The hello handshake; with `wait`, first wait (showing the phase on a terminal) until
    the daemon has loaded its model. Raises ReplyError(LOADING) without `wait`."""
    r = client.hello()
    shown = None
    while r.get("phase", "serving") != "serving":
        if not wait:
            from .client import ReplyError

            raise ReplyError({"error": {"name": "LOADING", "code": 13, "message":
                                        f"colibrid is {phase_line(r)}; "
                                        "--wait waits for it"}})
        if sys.stderr.isatty() and phase_line(r) != shown:
            shown = phase_line(r)
            click.echo(f"\rcolictl: colibrid is {shown}\033[K", nl=False, err=True)
        time.sleep(0.25)
        r = client.hello()
    if shown:
        click.echo("", err=True)
    return r


@cli.command()
@sampling_options(max_tokens=128)
@click.option("--stop", multiple=True, metavar="STR", help="stop when this string is generated (repeatable)")
@click.option("--chat", is_flag=True, help="wrap the prompt as one user message in the model's chat template")
@click.option("--session", metavar="NAME", help="continue the named conversation colibrid keeps for you: the "
                                               "prompt is its next turn (raw text; with --chat, a user message)")
@click.option("--json", "as_json", is_flag=True, help="print one JSON object instead of streaming text")
@input_errors_option
@click.option("--wait", is_flag=True, help="wait for colibrid to start (a minute for its socket) and to load its "
                                         "model, instead of exit 5 or 9")
@click.argument("prompt", required=False)
@with_client
def generate(client, max_tokens, temperature, top_k, top_p, seed, stop, chat, session, as_json, input_errors, wait,
             prompt):
    """Generate through colibrid. PROMPT, or stdin when absent or '-'. Ctrl-C cancels."""
    prompt = read_prompt(prompt, input_errors)
    stop = [text_arg(s, input_errors, "--stop") for s in stop]
    session = text_arg(session, "strict", "--session")
    hello = ready(client, wait)
    fields = sampling_fields(max_tokens, temperature, top_k, top_p, seed) | {"stop": stop}
    fields |= {"messages": [{"role": "user", "content": prompt}]} if chat else {"prompt": prompt}
    if session is not None:
        fields["session"] = session
    rid = client.send("generate", **fields)
    try:
        msg = stream_reply(client, rid, show=not as_json)
    except KeyboardInterrupt:
        client.send("cancel", target=rid)
        fail("cancelled", exitcodes.INTERRUPTED)
    if msg.get("status") != "ok":
        from .client import ReplyError

        if not as_json and msg.get("text"):
            sys.stdout.write("\n")  # the partial text streamed so far ends its line
        raise ReplyError(msg)
    model = hello.get("model") or {}
    precision = ((msg.get("stats") or {}).get("model") or model).get("precision") or {}
    lossy = f" ({precision_text(precision)})" if precision.get("lossy") else ""
    if as_json:
        click.echo(json.dumps({"prompt_token_ids": msg.get("prompt_token_ids"), "token_ids": msg["token_ids"],
                               "text": msg["text"], "finish_reason": msg["finish_reason"], "stats": msg["stats"],
                               **({"session": msg["session"]} if "session" in msg else {})}))
    else:
        sys.stdout.write("\n")  # the streamed text's line ends before stderr speaks
        sys.stdout.flush()
    if model.get("note"):  # the built-in demo says what it is
        click.echo(f"[colibri] {model['note']}", err=True)
    if as_json:
        if lossy:
            click.echo(f"[colibri] precision{lossy}", err=True)
        return
    s = msg["stats"]
    rate = f"{s['decode_tok_s']:.1f} tok/s" if s.get("decode_tok_s") else "-"
    click.echo(f"[colibri] {s['n_prompt_tokens']} prompt tokens, {s['n_generated_tokens']} generated ({rate}), "
               f"finish: {msg['finish_reason']}{lossy}", err=True)
    if "session" in msg:
        click.echo(f"[colibri] {session_line(msg['session'])}", err=True)


@cli.group()
def session():
    """Conversations colibrid keeps for you (chat/generate --session NAME)."""


@session.command("list")
@click.option("--json", "as_json", is_flag=True, help="one JSON object per session")
@with_client
def session_list(client, as_json):
    """Your sessions: turns, tokens, size, last use."""
    for info in client.call("session", action="list")["sessions"]:
        if as_json:
            click.echo(json.dumps(info))
        else:
            used = time.strftime("%Y-%m-%d %H:%M", time.localtime(info["updated"]))
            click.echo(f"{info['name']:24} {info['mode']:4} {turns(info['turns']):>9} {info['tokens']:7} tokens "
                       f"{info['bytes'] / 2**20:9.1f} MiB  {used}{'  (in use)' if info['in_use'] else ''}")


@session.command("show")
@click.option("--json", "as_json", is_flag=True, help="one JSON object")
@click.argument("name")
@with_client
def session_show(client, as_json, name):
    """One session: its summary, then the conversation."""
    info = client.call("session", action="show", name=text_arg(name, "strict", "NAME"))["session"]
    if as_json:
        click.echo(json.dumps(info))
        return
    click.echo(f"session {info['name']}: {info['mode']}, {turns(info['turns'])}, {info['tokens']} tokens, "
               f"{info['bytes'] / 2**20:.1f} MiB", err=True)
    if "messages" in info:
        for m in info["messages"]:
            click.echo(f"[{m['role']}] {m['content']}")
    else:
        click.echo(info.get("text", ""))


@session.command("rm")
@click.argument("names", nargs=-1, required=True, metavar="NAME...")
@with_client
def session_rm(client, names):
    """Delete sessions: each name removed or not is said; exit 4 if any was not."""
    from .client import ReplyError

    failed = []
    for name in names:
        try:
            client.call("session", action="rm", name=text_arg(name, "strict", "NAME"))
            click.echo(f"removed {name}")
        except ReplyError as e:
            if e.name not in ("NOT_FOUND", "BUSY", "INVALID_REQUEST"):
                raise
            click.echo(f"colictl: {name}: {e.name}: {e}", err=True)
            failed.append(name)
    if failed:
        raise SystemExit(exitcodes.BAD_REQUEST)


def turns(n: int) -> str:
    return f"{n} turn{'' if n == 1 else 's'}"


class DrivesGroup(LazyGroup):
    LAZY = {"stage": ("offline", "drives_stage"), "verify": ("offline", "drives_verify")}


@cli.group(cls=DrivesGroup)
def drives():
    """The drives the expert files are read from: copy them to another drive (stage), check a
    copy (verify), and show how the running daemon shares its reads among them (status)."""


@drives.command("status")
@click.option("--json", "as_json", is_flag=True, help="one JSON object per drive")
@with_client
def drives_status(client, as_json):
    """Each drive the daemon reads experts from: its share, speed, errors and whether it is in
    the rotation."""
    r = client.call("stats")
    ds = r.get("drives")
    if ds is None:
        fail(f"colibrid is {phase_line(r)}" if r.get("phase", "serving") != "serving" else
             "colibrid's model has every expert resident: it reads no expert files", exitcodes.BAD_REQUEST)
    for d in ds:
        click.echo(json.dumps(d) if as_json else drive_line(d))
        if not as_json:
            for name, why in d["left_out"].items():
                click.echo(f"  not used: {name}: {why}")


for _command in ops.COMMANDS:
    cli.add_command(_command)


def main():
    try:
        cli.main(standalone_mode=True)
    except KeyboardInterrupt:
        click.echo("colictl: interrupted", err=True)
        raise SystemExit(exitcodes.INTERRUPTED) from None
    except Exception as e:  # a bug: one line for the user; COLIBRI_DEBUG=1 shows the traceback
        import os

        if os.environ.get("COLIBRI_DEBUG"):
            raise
        click.echo(f"colictl: internal error: {type(e).__name__}: {e} (a bug: please report it; COLIBRI_DEBUG=1 "
                   "shows where)", err=True)
        raise SystemExit(exitcodes.INTERNAL) from None
