"""`colictl doctor`: read-only checks of a model and of the box it runs on, one line per
check, a non-zero exit when any fails, `--json` for scripts.

It changes nothing: it opens files read-only, moves no state aside and starts nothing.
The model is --model, else the configuration's (--config), else the demo model in the
state directory. `--deep` also reads every expert record and checks it against the
manifest's crc32 (with a progress bar on a terminal).
"""

import json
import os
import resource
import sys

import click

from . import exitcodes
from .offline import guarded
from .options import model_argument

OK, WARN, FAIL, SKIP = "ok", "warn", "FAIL", "skip"  # skip: a check this model cannot have


class Report:
    def __init__(self):
        self.checks: list[dict] = []

    def add(self, status: str, name: str, detail: str) -> None:
        self.checks.append({"status": status, "check": name, "detail": detail})

    @property
    def failed(self) -> bool:
        return any(c["status"] == FAIL for c in self.checks)


def check_model(r: Report, path: str, deep: bool) -> dict:
    """The model directory, by the checks placing makes (storage.placement.check_model,
    one line each), then its tokenizer; returns facts for the box checks (dense and expert
    bytes, a file to probe O_DIRECT on)."""
    from ..engine.registry import build_model
    from ..engine.tokenizer import Tokenizer
    from ..storage import placement
    from ..storage.container import Container
    from ..storage.errors import ColibriError
    from ..storage.gguf import tokenizer_spec

    facts: dict = {}
    try:
        model, store = placement.check_model(path, build_model, report=lambda name, detail: r.add(OK, name, detail))
    except ColibriError as e:
        r.add(FAIL, getattr(e, "check", "model"), str(e))
        return facts
    try:
        tok = Tokenizer(path, tokenizer_spec(path))
        where = "the file's tokenizer builds" if path.endswith(".gguf") else "tokenizer.json loads"
        r.add(OK, "tokenizer", where + ("" if tok.chat_template else
                                                         "; no chat template (--chat and colictl chat will not work)"))
    except ColibriError as e:
        r.add(FAIL, "tokenizer", str(e))
        return facts
    if path.endswith(".gguf"):  # its experts stream from the file: a container's facts, no checksums
        g = placement.GGUFExperts(store, model)
        facts.update(dense=g.dense_bytes, experts=g.expert_bytes, record_bytes=g.record_bytes,
                     probe=next(iter(g.records.values())).file)
        if deep:
            r.add(SKIP, "checksums", "a GGUF file carries no checksums to verify (a container made by colictl "
                                     "convert has a crc32 per expert record and per dense tensor)")
        return facts
    if not isinstance(store, Container):
        facts.update(dense=sum(sf.file_bytes for sf in store.files.values()), experts=0)
        if deep:
            r.add(SKIP, "checksums", "a plain checkpoint carries no checksums to verify (a container made by "
                                     "colictl convert has a crc32 per expert record and per dense tensor)")
        return facts
    streamed = placement.streamed_table_bytes(store)  # (not resident: their cache is counted apart)
    facts.update(dense=store.dense_bytes - streamed, experts=store.expert_bytes, record_bytes=store.record_bytes,
                 probe=next(iter(store.records.values())).file, tables=streamed)
    if deep:
        check_checksums(r, store)
    return facts


def check_checksums(r: Report, c) -> None:
    import mmap

    from ..storage.container import crc32

    recs = sorted(c.records.values(), key=lambda x: (x.file, x.offset))
    buf = mmap.mmap(-1, c.record_bytes)
    bad, fds = [], {}
    show = sys.stderr.isatty()
    try:
        for i, rec in enumerate(recs):
            fd = fds.get(rec.file)
            if fd is None:
                fd = fds[rec.file] = os.open(rec.file, os.O_RDONLY)
            try:
                n = os.preadv(fd, [buf], rec.offset)
                ok = n == rec.length and crc32(buf) == rec.crc32
            except OSError as e:
                ok, n = False, e.strerror
            if not ok:
                bad.append(f"{rec.layer}:{rec.expert} ({os.path.basename(rec.file)} at {rec.offset})")
            if show and (i % 64 == 0 or i + 1 == len(recs)):
                click.echo(f"\rchecking expert records: {i + 1}/{len(recs)}", nl=False, err=True)
    finally:
        for fd in fds.values():
            os.close(fd)
        if show:
            click.echo("", err=True)
    if bad:
        r.add(FAIL, "checksums", f"{len(bad)} of {len(recs)} expert records do not match the manifest: "
                                 f"{', '.join(bad[:5])}{' ...' if len(bad) > 5 else ''}")
    else:
        r.add(OK, "checksums", f"all {len(recs)} expert records match the manifest's crc32")
    check_dense_checksums(r, c)


def check_dense_checksums(r: Report, c) -> None:
    """Every dense tensor read and checked against the manifest (its header was checked when
    the container opened)."""
    from ..storage.errors import DenseChecksumMismatch

    if c.dense.crc32 is None:
        r.add(WARN, "dense_checksums", "this container has no checksums for its dense weights (converted by an "
                                       "older colibri): convert it again to have every byte checked")
        return
    bad = []
    for name in sorted(c.dense.where):
        try:
            c.dense.read(name)
        except DenseChecksumMismatch:
            bad.append(name)
    if bad:
        r.add(FAIL, "dense_checksums", f"{len(bad)} of {len(c.dense.where)} dense tensors do not match the "
                                       f"manifest: {', '.join(bad[:5])}{' ...' if len(bad) > 5 else ''}")
    else:
        r.add(OK, "dense_checksums", f"the header and all {len(c.dense.where)} dense tensors match the manifest's "
                                     "crc32")


def check_drives(r: Report, cfg, paths: list[str]) -> None:
    """The drives the experts stream from, how they queue reads, and what `tune_drives`
    changes (or would change) on them (storage/devices.py; nothing is written here)."""
    from ..storage.devices import discover, plan

    cpus = sorted(os.sched_getaffinity(0))
    for where in paths:
        d = discover(where)
        if d["device"] is None:
            r.add(OK, "drive", f"{where}: {d['why']}")
            continue
        how = (f"{where} is on {d['device']}" + (f" via {', '.join(d['via'])}" if d["via"] else "")
               + (f" (backed by {d['backing_file']})" if d["backing_file"] else "")
               + f": {d['model'] or 'model unknown'}, scheduler {d['scheduler']}, read-ahead {d['read_ahead_kb']} KiB, "
               f"{d['nr_requests']} requests queued at most, {'rotational' if d['rotational'] else 'solid state'}, "
               f"{len(d['irqs'])} interrupt vectors")
        steps = plan(d, cpus)
        todo = "; ".join(f"{s['what']} {s['from']} -> {s['to']}" for s in steps)
        if not steps:
            r.add(OK, "drive", how + "; set up as colibri reads best")
        else:
            r.add(OK if cfg.tune_drives else WARN, "drive", how + (f"; tune_drives sets at start: {todo}"
                                                                   if cfg.tune_drives else
                                                                   f"; tune_drives: true would set {todo}"))


def check_memory(r: Report, cfg, path: str, config_path: str | None, flags: dict, notes: list[dict],
                 facts: dict) -> None:
    """Whether the model fits with its budgets and the process, decided as colibrid decides
    it at start (storage.placement.fit_of, the budgets of the configuration colibrid would
    run: kept values included), and the RAM it will hold."""
    import psutil

    from ..daemon.kept import budget_refusal
    from ..engine.registry import build_model
    from ..storage.errors import BudgetInvalid
    from ..storage.placement import check_budgets
    from ..storage.sizes import fmt_bytes, parse_size

    try:
        fit = check_budgets(path, parse_size(cfg.expert_cache), parse_size(cfg.kv_cache), build_model,
                            cfg.table_budget())
    except BudgetInvalid as e:
        r.add(FAIL, "memory", budget_refusal(e, cfg, config_path, flags, notes))
        return
    facts["fit"] = fit
    avail = psutil.virtual_memory().available
    r.add(OK if fit.total_bytes < avail else WARN, "memory", f"{fit.text()}; {fmt_bytes(avail)} available now"
          + ("" if fit.total_bytes < avail else ": it starts, but other processes' memory would be swapped or the "
             "caches grow into the kernel's OOM killer"))


def check_box(r: Report, cfg, facts: dict, socket_path: str | None = None) -> None:
    from ..daemon import protocol as P
    from ..daemon.config import state_dir
    from ..storage.arena import meminfo

    if facts.get("probe"):
        try:
            fd = os.open(facts["probe"], os.O_RDONLY | os.O_DIRECT)
            import mmap

            buf = mmap.mmap(-1, 4096)
            try:
                os.preadv(fd, [buf], 0)
            finally:
                os.close(fd)
            r.add(OK, "o_direct", f"aligned O_DIRECT reads work on {os.path.dirname(facts['probe'])}")
        except OSError as e:
            r.add(WARN, "o_direct", f"O_DIRECT refused on {facts['probe']} ({e.strerror}): expert reads fall back to "
                                    "buffered reads through the page cache")
    if facts.get("probe"):
        check_drives(r, cfg, [os.path.dirname(facts["probe"]), *cfg.drives])
    fit = facts.get("fit")
    budget = fit.expert_bytes if fit else 0
    need = fit.total_bytes if fit else 0
    free_huge = meminfo("HugePages_Free") * 2 * 2**20  # free 2 MiB pages, in bytes
    if cfg.hugepages:
        r.add(OK if free_huge >= budget else WARN, "hugepages",
              f"{free_huge / 2**30:.2f} GiB of reserved 2 MiB pages free for a {budget / 2**30:.2f} GiB arena"
              + ("" if free_huge >= budget else ": the arena falls back to transparent hugepages (vm.nr_hugepages)"))
    else:
        try:
            thp = open("/sys/kernel/mm/transparent_hugepage/enabled").read().strip()
        except OSError:
            thp = "unknown"
        r.add(OK, "hugepages", f"not asked (hugepages: false); transparent hugepages: {thp}")
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    lim = "unlimited" if soft == resource.RLIM_INFINITY else f"{soft / 2**20:.0f} MiB"
    if cfg.mlock:
        enough = soft == resource.RLIM_INFINITY or soft >= need
        r.add(OK if enough else WARN, "memlock", f"RLIMIT_MEMLOCK {lim} for {need / 2**30:.2f} GiB to lock"
              + ("" if enough else ": raise it (LimitMEMLOCK= in the unit) or the lock falls back"))
    else:
        r.add(OK, "memlock", f"not asked (mlock: false); RLIMIT_MEMLOCK {lim}")
    sock = socket_path or cfg.socket or P.default_socket()
    if P.socket_path_problem(sock):
        r.add(FAIL, "socket", P.socket_path_problem(sock))
        sock = None
    folder = os.path.dirname(sock) or "."
    if os.path.isdir(folder):
        st = os.stat(folder)
        writable = os.access(folder, os.W_OK)
        r.add(OK if writable else FAIL, "socket", f"{folder} mode {st.st_mode & 0o777:o}, owner uid {st.st_uid}, "
                                                  f"{'writable' if writable else 'not writable'} by uid {os.getuid()}"
                                                  + (f"; {sock} exists" if os.path.exists(sock) else ""))
    else:
        parent = os.path.dirname(folder) or "."
        ok = os.access(parent, os.W_OK)
        r.add(OK if ok else FAIL, "socket", f"{folder} does not exist yet; colibrid {'can' if ok else 'cannot'} "
                                            f"create it in {parent}")
    state = state_dir(cfg)
    if os.path.isdir(state):
        r.add(OK if os.access(state, os.W_OK) else FAIL, "state", f"{state} is "
              f"{'' if os.access(state, os.W_OK) else 'not '}writable (usage history, demo model)")
    else:
        r.add(OK, "state", f"{state} does not exist yet; it is made at first start")


@click.command()
@model_argument("the model: a container, a GGUF file or a checkpoint (default: the configuration's, else the demo "
                "model)")
@click.option("--config", "config_path", metavar="PATH", help="colibrid's YAML configuration (budgets, socket, ...)")
@click.option("--expert-cache", metavar="SIZE", help="the expert budget to check, as colibrid's flag gives it: bytes, "
                                                    "KiB/MiB/GiB, min or all (default: the configuration's)")
@click.option("--deep", is_flag=True, help="also read every expert record and check its crc32")
@click.option("--json", "as_json", is_flag=True, help="one JSON object")
@click.pass_context
@guarded
def doctor(ctx, model_path, config_path, expert_cache, deep, as_json):
    """Check a model and this box, read-only: one line per check, exit 7 if any fails."""
    from ..daemon.config import load, state_dir
    from ..daemon.kept import effective, model_fingerprint
    from ..storage.demo import default_demo_path

    flags = {"expert_cache": expert_cache}
    cfg = load(config_path, flags)
    path = model_path or cfg.model or default_demo_path(state_dir(cfg))
    # the configuration colibrid would run this model with: its values kept with --persist too
    cfg, notes = effective(config_path, flags, model_fingerprint(path))
    r = Report()
    if not (os.path.isdir(path) or (path.endswith(".gguf") and os.path.isfile(path))):  # (a GGUF file is a model)
        r.add(FAIL, "model", f"{path}: no such directory" + ("" if model_path or cfg.model else
                                                             " (the demo model is written at colibrid's first start)"))
        facts = {}
    else:
        facts = check_model(r, path, deep)
        if not r.failed:
            check_memory(r, cfg, path, config_path, flags, notes, facts)
    check_box(r, cfg, facts, (ctx.obj or {}).get("socket"))
    if as_json:
        click.echo(json.dumps({"model": path, "ok": not r.failed, "checks": r.checks}))
    else:
        for c in r.checks:
            click.echo(f"{c['status']:<4} {c['check']:<10} {c['detail']}")
    if r.failed:
        raise SystemExit(exitcodes.CHECK_FAILED)
