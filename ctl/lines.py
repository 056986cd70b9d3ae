"""How colictl prints what colibrid reports: one line per thing a person reads (a boot step,
a drive, the cache, the plan, the usage history, a session)."""


def boot_line(got) -> str:
    """A boot step as a person reads it: "asked X, got Y (fallback)", else its value."""
    if isinstance(got, dict) and "asked" in got:
        more = ", ".join(f"{k} {v}" for k, v in got.items() if k not in ("asked", "got"))
        return f"asked {fmt_value(got['asked'])}, got {fmt_value(got['got'])}" + (f" ({more})" if more else "")
    return fmt_value(got)


def fmt_value(v) -> str:
    if isinstance(v, list) and all(isinstance(x, int) for x in v):
        return ",".join(map(str, v)) or "none"
    return str(v).lower() if isinstance(v, bool) else str(v)


def boot_drive_line(d: dict) -> str:
    """One drive of boot's report: what it is, how it queues reads, what tuning did."""
    if d.get("device") is None:
        return f"{d['path']}: {d.get('why', 'no block device')}"
    via = f" via {', '.join(d['via'])}" if d.get("via") else ""
    backing = f" (a loop device over {d['backing_file']})" if d.get("backing_file") else ""
    text = (f"{d['device']}{via}{backing} ({d.get('model') or 'unknown model'}) under {d['path']}: scheduler "
            f"{d.get('scheduler')}, read-ahead {d.get('read_ahead_kb')} KiB, queue {d.get('nr_requests')}, "
            f"{'rotational' if d.get('rotational') else 'solid state'}")
    if d.get("changed") is not None:
        steps = [f"{s['what']} {s['from']} -> {s['to']}" + ("" if s["done"] else f" NOT DONE ({s['why']})")
                 for s in d["changed"]]
        by = f" ({d['set_by']})" if d.get("set_by") else ""
        text += f"; set up{by}: {', '.join(steps) or 'nothing to change'}"
    elif d.get("would_change"):
        text += ("; tune_drives would set " + ", ".join(f"{s['what']} {s['from']} -> {s['to']}"
                                                       for s in d["would_change"]))
    return text


def plan_line(p: dict) -> str:
    """colictl tune's prediction at the current budget against the measured decode rate."""
    g = p["predicted"]
    got = (f"measured {p['measured_tok_s']:.2f} tok/s over {p['decode_steps']} decode steps"
           if p["measured_tok_s"] else "nothing decoded yet")
    return (f"plan: predicted {g['tok_s']:.2f} tok/s at a {100 * g['budget_fraction']:.0f} % expert budget "
            f"({g['bound']}-bound, hit rate {g['hit_rate']:.2f}), {got} (plan made {p['made']})")


def phase_line(r: dict) -> str:
    """`serving`, or what loading does now and how far it is."""
    phase, p = r.get("phase", "serving"), r.get("progress")
    if phase == "serving":
        return "serving"
    return f"loading: {phase}" + (f" ({p['done']}/{p['total']})" if p else "")


def history_line(h: dict) -> str:
    saved = f"saved {h['saved_age_s']:.0f} s ago" if h.get("saved_age_s") is not None else "not saved yet"
    where = h["path"] or "in memory only"
    size = f", {h['file_bytes'] / 1024:.0f} KiB" if h.get("file_bytes") else ""
    opt = h.get("optimum")
    taught = (f", learning from the optimum ({opt['trained']} reuses replayed, "
              f"{opt['optimum_kept'] or 0:.0%} kept, {opt['capacity']} slots)") if opt else ""
    return (f"{h['steps']} steps ({h['steps_loaded']} from before this start), age {h['age_s'] / 3600:.1f} h, "
            f"{h['experts_seen']} experts seen, {saved}{', read-only' if h['read_only'] else ''} ({where}{size})"
            f"{taught}")


def kv_line(kv: dict) -> str:
    return (f"kv: {kv['blocks']} blocks of {kv['block_tokens']} tokens, {kv['bytes'] / 2**20:.1f} of "
            f"{kv['budget_bytes'] / 2**20:.1f} MiB ({kv['held_blocks']} held by running requests), "
            f"{kv['hit_requests']} of {kv['lookups']} requests reused a prefix, {kv['saved_prefill_tokens']} prompt "
            f"tokens not computed again, {kv['evicted_blocks']} blocks evicted"
            + (f", {kv['state_snapshots']} recurrent-state snapshots kept" if kv.get("state_snapshots") else ""))


def tables_line(t: dict) -> str:
    """A model's streamed embedding tables' cache (TableCache.stats)."""
    hit = "-" if t["hit_rate"] is None else f"{100 * t['hit_rate']:.1f} %"
    return (f"tables: {t['bytes_read'] / 2**20:.1f} MiB read, hit rate {hit}, "
            f"{t['resident_bytes'] / 2**20:.1f} of {t['budget_bytes'] / 2**20:.1f} MiB held")


def session_line(info: dict) -> str:
    kept = (f"turn {info['turns']} kept, {info['tokens']} tokens" if info.get("saved")
            else "this turn was NOT kept (see colibrid's log)")
    return f"session {info['name']}: {info['reused_tokens']} tokens reused from its cache, {kept}"


def drive_line(d: dict) -> str:
    """One drive of the rotation, as `drives status` and `stats` show it."""
    state = "in rotation" if d["in_rotation"] else f"OUT for {d['back_in_s']:.0f} s more ({d['out_why']})"
    measured = f"measured {d['measured_gbs']:.2f} GB/s" if d["measured_gbs"] else "not measured (one drive)"
    lat = (f", latency p50 {d['latency_ms_p50']:.2f} ms p99 {d['latency_ms_p99']:.2f} ms"
           if d["latency_ms_p50"] is not None else "")
    left = f", {len(d['left_out'])} file(s) not used" if d["left_out"] else ""
    return (f"drive {d['drive']}: {d['path']}, {d['files']}/{d['of_files']} expert files{left}, {state}, {measured}; "
            f"{d['bytes'] / 2**20:.1f} MiB in {d['reads']} reads ({100 * d['share']:.1f} % of the bytes){lat}, "
            f"{d['errors']} errors, out of rotation {d['times_out']} times")

