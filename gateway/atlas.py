"""The live map's Atlas: each layer's experts placed by how often they are routed together.

Co-activation is counted from the routing the gateway sees (colibrid's map_request gives
every layer-step since the last one asked for) or read from a routing trace (`colictl run
--routing-trace`, given with --trace). A layer's layout is a spectral embedding of its
co-activation graph: the two eigenvectors after the first of the normalised adjacency
D^-1/2 A D^-1/2 (experts routed together land close), then k-means on those coordinates
marks the clusters. numpy only; a 256-expert layer takes a few milliseconds.
"""

import json

import numpy as np

CLUSTERS = 8


class Atlas:
    """Co-activation counts per layer, and the layout they give."""

    def __init__(self, layers: list[int], n_expert: int):
        self.layers, self.n_expert = list(layers), n_expert
        self.row = {il: i for i, il in enumerate(self.layers)}
        self.counts = np.zeros((len(self.layers), n_expert, n_expert), np.float32)
        self.uses = np.zeros((len(self.layers), n_expert), np.float32)
        self.steps = 0

    def add(self, il: int, ids) -> None:
        """One layer-step's routed union."""
        r = self.row.get(il)
        if r is None:
            return
        ids = np.asarray([i for i in ids if 0 <= i < self.n_expert], np.int64)
        if len(ids):
            self.counts[r][np.ix_(ids, ids)] += 1.0
            self.uses[r, ids] += 1.0
            self.steps += 1

    def add_trace(self, path: str) -> int:
        """Every line of a routing trace; returns the lines taken. Raises ValueError on one
        that is not a trace line."""
        n = 0
        with open(path) as f:
            for i, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    d = json.loads(line)
                    self.add(int(d["layer"]), [int(x) for x in d["experts"]])
                except (ValueError, KeyError, TypeError):
                    raise ValueError(f"{path}:{i}: not a routing trace line") from None
                n += 1
        return n

    def layout(self, il: int) -> dict:
        """{"x", "y" (in [-1, 1]), "cluster", "uses"} per expert of layer il."""
        r = self.row[il]
        a = self.counts[r].astype(np.float64)
        np.fill_diagonal(a, 0.0)
        a += 1e-3  # a graph with unseen experts stays connected: they gather near the middle
        d = a.sum(axis=1)
        inv = 1.0 / np.sqrt(d)
        m = inv[:, None] * a * inv[None, :]
        _, vecs = np.linalg.eigh(m)  # ascending: the last is the trivial one
        xy = vecs[:, -3:-1] * np.sqrt(d)[:, None]  # (undo the normalisation's scaling)
        xy -= xy.mean(axis=0)
        span = np.abs(xy).max(axis=0)
        xy /= np.where(span > 0, span, 1.0)
        return {"layer": il, "x": np.round(xy[:, 1], 4).tolist(), "y": np.round(xy[:, 0], 4).tolist(),
                "cluster": kmeans(xy, min(CLUSTERS, self.n_expert)).tolist(),
                "uses": self.uses[r].astype(int).tolist(), "steps": self.steps}


def kmeans(xy: np.ndarray, k: int, iters: int = 20) -> np.ndarray:
    """Cluster ids of the points (deterministic: farthest-point seeding from the first)."""
    centres = [xy[0]]
    for _ in range(1, k):
        dist = np.min([((xy - c) ** 2).sum(axis=1) for c in centres], axis=0)
        centres.append(xy[int(np.argmax(dist))])
    c = np.array(centres)
    label = np.zeros(len(xy), np.int64)
    for _ in range(iters):
        label = np.argmin(((xy[:, None, :] - c[None, :, :]) ** 2).sum(axis=2), axis=1)
        for j in range(k):
            if np.any(label == j):
                c[j] = xy[label == j].mean(axis=0)
    return label
