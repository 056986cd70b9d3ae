"""The order of a layer's expert records in its file. By default, expert id order. The
co-activation layout (`colictl convert --layout coactivation --trace FILE`) puts experts
that the router chooses together next to each other, so that a step's missing experts are
often adjacent records, which the reader fetches as one request (storage/reader.py).

From a routing trace (`colictl run --routing-trace`: one JSON line per MoE layer per
forward step, {"step", "layer", "experts"}), per layer: how often each pair of experts
was chosen in the same step, and how often each expert was. The order is a greedy chain
(the nearest-neighbour heuristic for this travelling-salesman problem): start from the
most used expert, then append the unplaced expert chosen most often together with the
chain's last one (ties: the more used, then the lower id); experts the trace never saw
go last, in id order. Placement only: the records' bytes, the manifest's index and every
token are unchanged.
"""

import hashlib
import json

import numpy as np

from .errors import ColibriError


class TraceInvalid(ColibriError):
    """A routing trace that cannot be read (names the file and line)."""


def trace_steps(path: str, moe_layers: list[int], n_expert: int, digest=None):
    """Each line of a routing trace (colictl run --routing-trace) as (layer, experts, the
    lookahead's prediction or None), its bytes fed to `digest` (a hashlib object) when
    given. Raises TraceInvalid (a line that is not one, text that is not UTF-8 JSON, a
    layer or expert not this model's, no line at all), OSError."""
    layers, lines = set(moe_layers), 0
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            if digest is not None:
                digest.update(raw)
            if not raw.strip():
                continue
            try:
                rec = json.loads(raw)
                il, ids = rec["layer"], [int(e) for e in rec["experts"]]
                ahead = [int(e) for e in rec["predicted"]] if "predicted" in rec else None
            except (ValueError, KeyError, TypeError):  # (UnicodeDecodeError is a ValueError)
                raise TraceInvalid(f"{path}, line {n}: not a routing trace line ({{\"layer\", \"experts\"}} as "
                                   "JSON; colictl run --routing-trace writes them)") from None
            if il not in layers or any(not 0 <= e < n_expert for e in ids):
                raise TraceInvalid(f"{path}, line {n}: layer {il} or its experts are not this model's "
                                   f"(MoE layers {moe_layers[0]}..{moe_layers[-1]}, experts 0..{n_expert - 1})")
            lines += 1
            yield il, ids, ahead
    if not lines:
        raise TraceInvalid(f"{path}: an empty routing trace")


def read_trace(path: str, moe_layers: list[int], n_expert: int) -> tuple[dict[int, np.ndarray], dict[int, np.ndarray],
                                                                         str]:
    """Per MoE layer: the pair counts [E, E] and the use counts [E]; and the trace's
    sha256. Raises TraceInvalid, OSError."""
    pairs = {il: np.zeros((n_expert, n_expert), np.int64) for il in moe_layers}
    uses = {il: np.zeros(n_expert, np.int64) for il in moe_layers}
    h = hashlib.sha256()
    for il, ids, _ in trace_steps(path, moe_layers, n_expert, h):
        idx = np.asarray(sorted(set(ids)))
        uses[il][idx] += 1
        pairs[il][np.ix_(idx, idx)] += 1
    for il in moe_layers:
        np.fill_diagonal(pairs[il], 0)
    return pairs, uses, "sha256:" + h.hexdigest()[:32]


def chain(pairs: np.ndarray, uses: np.ndarray) -> list[int]:
    """The greedy co-activation chain of one layer's experts (see the module's text)."""
    n = len(uses)
    seen = [e for e in range(n) if uses[e]]
    if not seen:
        return list(range(n))
    left = set(seen)
    order = [max(seen, key=lambda e: (uses[e], -e))]
    left.discard(order[0])
    while left:
        last = order[-1]
        nxt = max(left, key=lambda e: (pairs[last, e], uses[e], -e))
        order.append(nxt)
        left.discard(nxt)
    return order + [e for e in range(n) if not uses[e]]


def coactivation_order(path: str, moe_layers: list[int], n_expert: int) -> tuple[dict[int, list[int]], str]:
    """Per MoE layer, the experts in the order their records are to be written; and the
    trace's fingerprint. Raises TraceInvalid, OSError."""
    pairs, uses, fp = read_trace(path, moe_layers, n_expert)
    return {il: chain(pairs[il], uses[il]) for il in moe_layers}, fp
