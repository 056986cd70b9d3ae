"""/metrics: colibrid's stats in the Prometheus text format (prometheus_client), rendered
at each scrape from one stats request. Names follow Prometheus' conventions: `_total`
counters, `_seconds` and `_bytes` units, histograms for latencies, labels of few values
(a layer, a drive, an outcome). A daemon that does not answer gives `colibri_up 0`."""

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.exposition import generate_latest
from prometheus_client.registry import Collector, CollectorRegistry


def _histogram(name: str, doc: str, h: dict) -> HistogramMetricFamily:
    buckets = [(str(le), c) for le, c in zip(h["le"], h["cumulative"])] + [("+Inf", h["count"])]
    return HistogramMetricFamily(name, doc, buckets=buckets, sum_value=h["sum"])


def families(stats: dict | None) -> list:
    """The metric families of one stats reply (None: the daemon did not answer)."""
    up = GaugeMetricFamily("colibri_up", "1 when colibrid answered this scrape")
    up.add_metric([], 0 if stats is None else 1)
    out = [up]
    if stats is None:
        return out
    g = GaugeMetricFamily("colibri_uptime_seconds", "seconds since colibrid started")
    g.add_metric([], stats.get("uptime_s", 0))
    out.append(g)
    serving = GaugeMetricFamily("colibri_serving", "1 once the model is placed, 0 while loading")
    serving.add_metric([], 1 if stats.get("phase", "serving") == "serving" else 0)
    out.append(serving)
    req = stats.get("requests") or {}
    c = CounterMetricFamily("colibri_requests", "generate requests by how they ended", labels=["outcome"])
    for outcome in ("served", "rejected", "failed", "cancelled"):
        c.add_metric([outcome], req.get(outcome, 0))
    out.append(c)
    c = CounterMetricFamily("colibri_requests_accepted", "generate requests accepted")
    c.add_metric([], req.get("accepted", 0))
    out.append(c)
    c = CounterMetricFamily("colibri_tokens_generated", "tokens generated")
    c.add_metric([], req.get("tokens", 0))
    out.append(c)
    lat = stats.get("latency")
    if lat:
        out.append(_histogram("colibri_time_to_first_token_seconds", "from a request's arrival to its first token",
                              lat["ttft_s"]))
        out.append(_histogram("colibri_inter_token_latency_seconds", "between two tokens of a request",
                              lat["itl_s"]))
    q = stats.get("queue")
    if q:
        g = GaugeMetricFamily("colibri_queue_requests", "generate requests running and waiting", labels=["state"])
        g.add_metric(["active"], q["active"])
        g.add_metric(["queued"], q["queued"])
        out.append(g)
    layers = stats.get("experts_by_layer")
    if layers:
        for key, name, doc in (("hits", "colibri_expert_hits", "experts found in RAM, per MoE layer"),
                               ("misses", "colibri_expert_misses", "experts read from disk, per MoE layer"),
                               ("bytes_read", "colibri_expert_read_bytes", "expert bytes read, per MoE layer")):
            c = CounterMetricFamily(name, doc, labels=["layer"])
            for row in layers:
                c.add_metric([str(row["layer"])], row[key])
            out.append(c)
    e = stats.get("experts")
    if e:
        for key, name, doc in (("io_wait_s", "colibri_expert_io_wait_seconds", "time the engine waited for reads"),
                               ("moe_s", "colibri_expert_layer_seconds", "time in the routed experts, waits included"),
                               ("verify_s", "colibri_expert_verify_seconds", "time checking reads' checksums")):
            c = CounterMetricFamily(name, doc)
            c.add_metric([], e.get(key) or 0)
            out.append(c)
        c = CounterMetricFamily("colibri_expert_compute_seconds", "time in the routed experts not waiting for reads")
        c.add_metric([], max(0.0, (e.get("moe_s") or 0) - (e.get("io_wait_s") or 0)))
        out.append(c)
        c = CounterMetricFamily("colibri_prefetch_reads", "router-lookahead reads by what became of them",
                                labels=["result"])
        c.add_metric(["used"], e.get("prefetch_used", 0))
        c.add_metric(["wasted"], e.get("prefetch_wasted", 0))
        out.append(c)
        if e.get("prefetch_precision") is not None:
            g = GaugeMetricFamily("colibri_prefetch_precision", "lookahead reads the router then chose, of those settled")
            g.add_metric([], e["prefetch_precision"])
            out.append(g)
        if e.get("hit_rate") is not None:
            g = GaugeMetricFamily("colibri_expert_hit_rate", "hits over experts served since start")
            g.add_metric([], e["hit_rate"])
            out.append(g)
        for key, name, doc in (("read_requests", "colibri_expert_read_requests", "reads issued to the drives"),
                               ("read_errors", "colibri_expert_read_errors", "failed or corrupted read attempts")):
            c = CounterMetricFamily(name, doc)
            c.add_metric([], e.get(key, 0))
            out.append(c)
    mem = stats.get("memory") or {}
    for key, name, doc in (("rss_bytes", "colibri_resident_memory_bytes", "colibrid's resident memory"),
                           ("expert_budget_bytes", "colibri_expert_cache_budget_bytes", "the expert cache's budget"),
                           ("expert_arena_bytes", "colibri_expert_arena_bytes", "the expert cache's arena")):
        if key in mem:
            g = GaugeMetricFamily(name, doc)
            g.add_metric([], mem[key])
            out.append(g)
    kv = stats.get("kv")
    if kv:
        g = GaugeMetricFamily("colibri_kv_cache_bytes", "the prefix cache's KV bytes")
        g.add_metric([], kv["bytes"])
        out.append(g)
        c = CounterMetricFamily("colibri_kv_saved_prefill_tokens", "prompt tokens taken from the prefix cache")
        c.add_metric([], kv["saved_prefill_tokens"])
        out.append(c)
    h = stats.get("history")
    if h and h.get("age_s") is not None:
        g = GaugeMetricFamily("colibri_usage_history_age_seconds", "age of the usage history the cache learns from")
        g.add_metric([], h["age_s"])
        out.append(g)
    drives = stats.get("drives")
    if drives:
        for key, name, doc in (("bytes", "colibri_drive_read_bytes", "expert bytes read from each drive"),
                               ("reads", "colibri_drive_reads", "read requests to each drive"),
                               ("errors", "colibri_drive_errors", "failed reads on each drive")):
            c = CounterMetricFamily(name, doc, labels=["drive"])
            for d in drives:
                c.add_metric([str(d["drive"])], d[key])
            out.append(c)
        g = GaugeMetricFamily("colibri_drive_in_rotation", "1 while the drive shares the reads", labels=["drive"])
        for d in drives:
            g.add_metric([str(d["drive"])], 1 if d["in_rotation"] else 0)
        out.append(g)
    return out


class _Once(Collector):
    def __init__(self, fams):
        self.fams = fams

    def collect(self):
        return iter(self.fams)


def render(stats: dict | None) -> bytes:
    """The Prometheus text exposition of one stats reply."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Once(families(stats)))
    return generate_latest(registry)
