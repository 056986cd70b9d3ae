"""The MoE dispatch: the routers' top-k helpers, and moe(), which takes a layer step's
union of experts from the ExpertSource, computes each batch as it arrives on the crew's
threads and sums every token's expert outputs in a fixed order."""

import threading
import time

import numpy as np

from ..storage.experts import ExpertSource, QuantWeight, int4_of
from . import crew, kernels
from .formats import intdot
from .layers import swiglu
from .sequence import Segment, Step


def softmax(logits: np.ndarray) -> np.ndarray:
    # [T, E] f32, along the last axis
    z = logits - logits.max(axis=-1, keepdims=True)
    e = np.exp(z, dtype=np.float32)
    return e / e.sum(axis=-1, keepdims=True)


def top_k(probs: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    # probs [T, E] -> ids [T, k] (descending, ties to the lower index), values [T, k]
    ids = np.argsort(-probs, axis=-1, kind="stable")[:, :k]
    return ids, np.take_along_axis(probs, ids, axis=-1)


def sigmoid_top_k(logits: np.ndarray, bias: np.ndarray, k: int, n_group: int, topk_group: int, renormalise: bool,
                  scaling: float) -> tuple[np.ndarray, np.ndarray]:
    # logits [T, E] f32 -> ids [T, k], weights [T, k] (DeepSeek-V3's router, and the families
    # that took it): sigmoid scores; the choice adds the bias, keeps the topk_group groups with
    # the best two-expert sums, then the top k; the weights are the scores without the bias,
    # renormalised if asked, times the scaling
    T, E = logits.shape
    scores = (1.0 / (1.0 + np.exp(-logits))).astype(np.float32)  # [T, E]
    choice = scores + bias  # [T, E]
    groups = choice.reshape(T, n_group, E // n_group)  # [T, G, E/G]
    group_scores = np.sort(groups, axis=-1)[..., -2:].sum(-1)  # [T, G]
    kept = np.argsort(-group_scores, axis=-1, kind="stable")[:, :topk_group]  # [T, topk_group]
    mask = np.zeros((T, n_group), bool)
    np.put_along_axis(mask, kept, True, axis=-1)
    choice = np.where(np.repeat(mask, E // n_group, axis=-1), choice, -np.inf)  # [T, E]
    ids = np.argsort(-choice, axis=-1, kind="stable")[:, :k]  # [T, A]
    w = np.take_along_axis(scores, ids, axis=-1)  # [T, A]
    if renormalise:
        w = w / (w.sum(-1, keepdims=True) + np.float32(1e-20))
    return ids, (w * np.float32(scaling)).astype(np.float32)


def softmax_top_k(logits: np.ndarray, k: int, renormalise: bool) -> tuple[np.ndarray, np.ndarray]:
    # logits [T, E] -> ids [T, k], weights [T, k]: softmax over all experts, then the top k,
    # optionally renormalised to sum to 1
    ids, w = top_k(softmax(logits), k)
    if renormalise:
        w = w / w.sum(axis=-1, keepdims=True)
    return ids, w


def compute_rows(parts, x, A, w_flat, prompt_rows, ys, g, ffn=None, clamped=None, team=None, tok_team=None,
                 session=None, integer=False) -> None:
    # parts: [(rows, expert weights)], rows (t * A + a) of x [T, D] that chose the expert, each
    # row's output times its weight w_flat[row] into ys [T * A, D]. Each expert's rows by path:
    # a quantized expert's prompt rows (prompt_rows[t]: a sequence with several tokens in this
    # step) take the prompt path, its other rows the decode path; float experts have one path.
    # int4 decode rows: the crew's int4 job (`team`, group g); prompt rows and float experts:
    # its prompt-path job (`tok_team`, one per kind and shape); the rest one expert at a time,
    # side by side. With `integer` (activations int8), int8 and int4 experts take the crew's
    # integer job (formats/intdot.py), all their rows, prompt or not. A row's result does not
    # depend on the others computed with it, so a worker computing some of a step's experts
    # (daemon/scaleout.py) gives the same rows.
    crew_ffn = ffn is None or clamped is not None  # the crew's jobs compute this expert
    any_prompt = bool(prompt_rows.any())
    q4, tok, rest, i8 = [], {}, [], {}
    for r, ew in parts:  # per expert per layer step: a decode step's int4 experts ask no more than they must
        quant = isinstance(ew[0], QuantWeight)
        if integer and quant and ew[0].kind in ("int8", "int4"):  # in tiles (MoEModel.set_activations saw to it)
            if not (crew_ffn and all(isinstance(w, QuantWeight) and intdot.takes(w) for w in ew[:3])):
                raise ValueError("activations int8: an expert the integer job cannot take")
            i8.setdefault(tuple(w.layout for w in ew[:3]), []).append((r, ew))
            continue
        facts = int4_of(ew) if quant else None
        q4_ok = crew_ffn and team is not None and facts is not None and facts[0] == g
        p = prompt_rows[r // A] if quant and any_prompt else None  # a quantized expert's prompt rows
        kind = crew.tok_kind(*ew[:3]) if crew_ffn and (p is not None or not q4_ok) else None
        for sub, prompt in ((r, False),) if p is None else ((r[p], True), (r[~p], False)):
            if not len(sub):
                continue
            if (prompt or not quant) and kind is not None:
                tok.setdefault((kind, crew._signature(ew[0])), []).append((sub, ew))
            elif not prompt and q4_ok:
                q4.append((sub, ew))
            else:
                rest.append((sub, ew, prompt))

    def expert(part):  # rows of an expert the crew does not take, on their own
        r, ew, prompt = part
        if ffn is not None:
            ys[r] = ffn(x[r // A], ew) * w_flat[r][:, None]
        else:
            ys[r] = swiglu(x[r // A], *ew, prompt) * w_flat[r][:, None]

    def run(job, parts):  # one crew job over (rows, expert weights) parts of one kind and shape
        rows = np.concatenate([r for r, _ in parts])
        starts = np.zeros(len(parts) + 1, np.int64)
        np.cumsum([len(r) for r, _ in parts], out=starts[1:])
        job(x, rows, starts, A, w_flat, [ew for _, ew in parts], ys, clamped)

    if q4:
        run(team.experts, q4)
    for parts_ in i8.values():
        run(tok_team.experts_i8, parts_)
    for parts_ in tok.values():
        run(tok_team.experts_tok, parts_)
    if not crew.threads_set() or len(rest) <= 1:
        for part in rest:
            expert(part)
    else:  # the kernels release the GIL: the experts run side by side, the crews parked meanwhile
        for c in (team, tok_team, session):  # (their helpers would spin on the CPUs the pool's threads need)
            if c is not None:
                c.close()
        crew.run_shared(rest, expert)


def worker_rows(batches, rows_of: dict, x, A, w_flat, prompt_rows, g, ffn=None, clamped=None,
                integer=False) -> np.ndarray:
    # what moe() computes for some of a step's experts, on crews of its own (a worker that holds
    # them: daemon/scaleout.py): batches of [(expert, weights)] as a source streams them,
    # rows_of[expert] its rows (t * A + a) -> ys [T * A, D], zero outside those rows
    ys = np.zeros((len(w_flat), x.shape[1]), np.float32)
    team = crew.Crew(g, share=True) if g and not bool(np.all(prompt_rows)) else None
    tok_team = team if team is not None else crew.Crew(64, share=True)
    try:
        for batch in batches:
            compute_rows([(rows_of[ie], ew) for ie, ew in batch], x, A, w_flat, prompt_rows, ys, g, ffn, clamped,
                         team, tok_team, None, integer)
    finally:
        for c in {id(c): c for c in (team, tok_team) if c is not None}.values():
            c.close()
    return ys


_OUTPUTS = threading.local()  # a thread's buffer for a layer's expert outputs
OUTPUTS_KEEP = 64 << 20  # bytes of it a thread keeps from one layer step to the next


def expert_outputs(n: int, D: int) -> np.ndarray:
    """[n, D] float32 for a layer step's expert outputs, every row of which the step writes
    before it is read: this thread's buffer, kept from step to step up to OUTPUTS_KEEP. A
    512-token step's 32 MiB is past what malloc keeps (reuse_freed_memory), and zeroed fresh
    pages for it each layer were 3 ms of the layer."""
    if n * D * 4 > OUTPUTS_KEEP:
        return kernels.empty_aligned((n, D))
    buf = getattr(_OUTPUTS, "buf", None)
    if buf is None or buf.size < n * D:
        buf = _OUTPUTS.buf = kernels.empty_aligned(n * D)
    return buf[: n * D].reshape(n, D)


def moe(x: np.ndarray, ids: np.ndarray, weights: np.ndarray, experts: ExpertSource, il: int, step: Step | None = None,
        ffn=None, clamped: tuple | None = None) -> np.ndarray:
    # x [T, D] normed; ids, weights [T, A] from the family's route() -> [T, D]. ffn(x [n, D],
    # expert weights) -> [n, D]: a family's own expert (biases, another activation); None:
    # SwiGLU of (gate, up, down), which the crew's jobs also compute. clamped: (alpha, limit)
    # when ffn is gpt-oss's biased, clamped SwiGLU, which the crew computes too
    # (crew.ACT_CLAMPED). A layer step's experts are one or two crew jobs over (expert, row
    # block) units, no Python per expert: the int4 decode rows, and the prompt rows of every
    # kind with the rows of float experts; only what the jobs cannot take runs expert by expert
    t0 = time.perf_counter()
    T, A = ids.shape
    # rows of a prompt (a sequence with several tokens in this step) take the int4 kernels'
    # prompt-token path, the others the decode path: a row takes the same path alone or batched
    segments = step.segments if step is not None else [Segment(None, 0, T)]
    prompt_rows = np.zeros(T, bool)
    for sg in segments:
        prompt_rows[sg.start : sg.start + sg.n] = sg.n > 1
    all_prompt = all(sg.n > 1 for sg in segments)
    any_prompt = any(sg.n > 1 for sg in segments)
    g = experts.int4_group
    session = crew.session()  # the forward step's crew, else one for this call
    # int4 decode rows: a crew of their group size; the prompt-path job: any crew
    team = session if session is not None and session.g == g else crew.Crew(g, share=True) if g and not all_prompt else None
    tok_team = session if session is not None else team if team is not None else crew.Crew(64, share=True)

    x = np.ascontiguousarray(x, dtype=np.float32)
    ys = expert_outputs(T * A, x.shape[1])  # [T * A, D] each token's expert outputs, row t * A + a
    w_flat = np.ascontiguousarray(weights, dtype=np.float32).reshape(T * A)
    # the rows (t * A + a) that chose each expert, from one sort: a token picks an expert at most
    # once; union[k]'s rows are order[bounds[k]:bounds[k + 1]]
    flat = ids.reshape(T * A)
    order = np.argsort(flat, kind="stable")
    by_expert = flat[order]
    if T == 1:  # one token (a decode step): each of its experts once
        bounds = np.arange(A + 1)
    else:
        bounds = np.concatenate(([0], np.flatnonzero(by_expert[1:] != by_expert[:-1]) + 1, [T * A]))
    union = by_expert[bounds[:-1]].tolist()  # each expert of the step once

    if step is not None and len(step.segments) > 1:  # what the sequences would have asked for alone
        routed = sum(len(np.unique(ids[sg.start : sg.start + sg.n])) for sg in step.segments)
    else:
        routed = len(union)

    integer = getattr(experts, "activations", "float32") == "int8"

    def compute(parts):  # [(rows, expert weights)] of this step into ys
        compute_rows(parts, x, A, w_flat, prompt_rows, ys, g, ffn, clamped, team, tok_team, session, integer)

    hits = None
    if ffn is None and team is not None and not any_prompt:
        hits = experts.int4_hits(il, union)  # every expert resident: their addresses, no views
    rows_of = [(ie, order[bounds[k] : bounds[k + 1]]) for k, ie in enumerate(union)] if hits is None else []
    rows_by = dict(rows_of)
    try:
        if hits is not None:  # one decode job straight from the cache's slots (the rows in union order)
            g4, layouts, addrs = hits
            team.experts_at(x, order, bounds, A, w_flat, addrs, g4, layouts, ys, bits=4 if integer else None)
        elif experts.compute_into(il, rows_of, x, w_flat, prompt_rows, A, ys, compute, ffn, clamped):
            pass  # a source that computed some experts elsewhere (ffn went along)
        else:
            for batch in experts.stream(il, union):  # in any order
                compute([(rows_by[ie], ew) for ie, ew in batch])
    finally:
        for c in {id(c): c for c in (team, tok_team) if c is not None and c is not session}.values():
            c.close()
    out = np.empty_like(x)
    # slot by slot, a fixed order: the same sum whatever order the experts came in
    (kernels.sum_slots_par if out.size >= kernels.ROWS_PAR_MIN else kernels.sum_slots)(ys, A, out)
    experts.layer_done(il, routed, time.perf_counter() - t0)
    return out
