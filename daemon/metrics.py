"""Latency histograms the daemon keeps for stats (and the gateway's /metrics): time to
first token (from the request's arrival at the daemon) and the time between two tokens of
a request. Cumulative buckets as Prometheus histograms have them; the engine thread
observes, the I/O thread reads (a snapshot of a few lists: no lock needed for a view that
may be one token behind)."""

import time

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class Histogram:
    def __init__(self, buckets: tuple[float, ...]):
        self.buckets = buckets
        self.counts = [0] * len(buckets)  # per bucket (not cumulative), the last one +Inf beyond
        self.over = 0
        self.sum, self.count = 0.0, 0

    def observe(self, v: float) -> None:
        for i, b in enumerate(self.buckets):
            if v <= b:
                self.counts[i] += 1
                break
        else:
            self.over += 1
        self.sum += v
        self.count += 1

    def as_dict(self) -> dict:
        """{"le": [bounds], "cumulative": [counts up to each bound], "sum", "count"}."""
        cum, total = [], 0
        for c in self.counts:
            total += c
            cum.append(total)
        return {"le": list(self.buckets), "cumulative": cum, "sum": round(self.sum, 6), "count": self.count}


class Latencies:
    """Per request: when it arrived and when its last token went out."""

    def __init__(self):
        self.ttft, self.itl = Histogram(TTFT_BUCKETS), Histogram(ITL_BUCKETS)
        self.arrived: dict = {}  # key -> arrival time
        self.last: dict = {}  # key -> the last token's time

    def arrive(self, key) -> None:
        self.arrived[key] = time.monotonic()

    def token(self, key) -> None:
        now = time.monotonic()
        if key in self.last:
            self.itl.observe(now - self.last[key])
        elif key in self.arrived:
            self.ttft.observe(now - self.arrived[key])
        self.last[key] = now

    def done(self, key) -> None:
        self.arrived.pop(key, None)
        self.last.pop(key, None)

    def as_dict(self) -> dict:
        return {"ttft_s": self.ttft.as_dict(), "itl_s": self.itl.as_dict()}
