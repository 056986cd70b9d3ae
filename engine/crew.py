"""The thread crew: the parallel work of a forward step (a layer's experts: int4 on the
decode path, every kind on the prompt path, float experts on both; the big dense matrices)
shared by this thread and the crew threads, inside one kernel.

A Crew publishes jobs on an int64 board (laid out in jobs.py); its helpers stay in the
kernel between jobs (spinning, so nothing has to wake them) and take units of each job
from atomic counters. The compute threads (`set_threads`, `run_shared`) that run a batch's
other experts side by side live here too.
"""

import threading
from contextlib import contextmanager

import numba as nb
import numpy as np

from ..storage.experts import FORMATS, QuantWeight, bf16_to_f32, int4_of
from .atomics import atomic_add, atomic_load, f32_at, i8_at, i64_at, u8_at, u16_at, yield_cpu
from .formats import intdot
from .formats.int4 import q4_matmul, q4_split_row
from .formats.intdot import idot, quantize_row, record_len
from .jit import JIT
from .jobs import (
    ACT_CLAMPED,
    ACT_SILU,
    BOARD_HEAD,
    DTYPE_CODES,
    I8_IN_ROWS,
    I8_OUT_ROWS,
    JOB_F32,
    JOB_I8,
    JOB_LEN,
    JOB_MOE_I8,
    JOB_MOE_Q4,
    JOB_MOE_TOK,
    JOB_U16,
    MOE_IN_ROWS,
    MOE_OUT_ROWS,
    N_ADDRS,
    N_TABLE,
    W_BF16,
    W_F32,
    activate,
    check_expert_job,
    describe_matmul,
    describe_matmul_i8,
    describe_moe_i8,
    describe_moe_q4,
    describe_moe_tok,
    expert_job,
    moe_i8_sizes,
    moe_q4_ints,
    moe_q4_sizes,
    moe_tok_sizes,
    weigh,
    widen_rows,
)
from .kernels import (
    BF16_DIRECT_TOKENS,
    ROW_BLOCK,
    ROWS_PER_TASK,
    aligned,
    carve,
    empty_aligned,
    f16_lut,
    matmul_u16_rows,
    rows_aligned,
    tiles,
)

SPIN_LIMIT = 20_000_000  # spins a helper waits for the next job before it leaves (~10-40 ms)
YIELD_EVERY = 4096  # spins between two offers of the CPU to other threads (a few microseconds)
CREW_MIN_ELEMENTS = 2**18  # a crew job costs ~10 us to publish, no thread to wake: worth it from 256 Ki weights

def _make_crew(g: int, path: int):
    # the crew kernel for int4 experts of group g (a constant, as in formats/int4.py _make_q4),
    # its integer dot products on instruction path `path` (formats/intdot.py)
    half = g // 2

    @nb.njit(**JIT)
    def crew_g(board, job, f16_lut, serve):
        # The parallel work of a forward step, shared by threads (Crew). `board` (int64):
        # board[0] the jobs published, board[1] nonzero once closed, board[2] the helpers in the
        # kernel, board[3] the units they did; job j's descriptor at BOARD_HEAD + j * JOB_LEN, its kind first:
        # - JOB_MOE_Q4: the decode path of int4 experts of group g: addresses and sizes of
        #   x_all [T_all, D] f32; ints: rows [R], starts [E + 1], addrs [E, N_ADDRS], ctl
        #   [2 + 3 E] (int64, one after the other); work f32 [n_work]; wts [T_all * A] f32; ys
        #   [T_all * A, D] f32; I, A; the activation and its params (f32 [2]). Expert e's rows
        #   are rows[starts[e]:starts[e + 1]], the flat positions token * A + slot that chose
        #   it; addrs[e] the addresses of its gate q [I, D/2] uint8, gate scales [I, D/g] f16
        #   bits, up q, up scales, down q [D, I/2], down scales [D, I/g], then of its gate, up
        #   and down biases f32 [I], [I], [D] or 0 (C-contiguous, alive through the job: the
        #   caller vouches for them, the kernel cannot see their shapes); ys[r] = wts[r] *
        #   (down act(gate x + gb, up x + ub) + db) for x = x_all[r // A], act silu(g) * u
        #   (ACT_SILU) or min(g, l) * sigmoid(alpha min(g, l)) * (clip(u, -l, l) + 1)
        #   (ACT_CLAMPED, params alpha, l); work >= R * (2 D + D/g + 3 I + I/g) scratch; ctl
        #   zeros, the job's counters.
        # - JOB_MOE_TOK: experts of any kind (W_*) as the prompt path computes them: the same
        #   fields as JOB_MOE_Q4 (addrs[e]: each matrix's values, then its scales or 0), then
        #   the weights' kind, a value table (N_TABLE f32: FP8's, or MXFP4's e2m1 and e8m0) and
        #   the rows and columns one scale covers in gate/up and in down. Units: each expert's
        #   rows gathered; its gate and up rows MOE_IN_ROWS at a time, widened to float32
        #   ROW_BLOCK rows at a time (widen_rows: exact) and tiled with the expert's tokens
        #   (bf16 for up to BF16_DIRECT_TOKENS and f32 tiled as they are), then the activation; its
        #   down rows MOE_OUT_ROWS at a time, the same way, then bias and weighting. The
        #   result of a (token, row) is the kind's prompt-token kernel's (qlinear), whatever
        #   else is in the job; work >= R * (2 D + 2 I).
        # - JOB_U16, JOB_F32: addresses and sizes of x [T, D] f32, w [N, D] (bf16 or f16 bits,
        #   or f32), out [T, N] f32, ctl [2] int64 zeros, then is_bf16: out = x @ w.T,
        #   ROWS_PER_TASK rows a unit, as matmul_u16 and matmul_f32 compute it.
        # - JOB_I8: a dense int8 / int4 matrix in tiles times quantised activations
        #   (jobs.describe_matmul_i8), I8_IN_ROWS rows a unit, as formats/intdot.py's linear computes it.
        # serve == 0: publish job `job` and do it with whoever joins, returning when it is
        # done. serve == 1 (a helper): do each job from `job` on as it is published, until the
        # board is closed or nothing comes for SPIN_LIMIT spins.
        # A job is cut into units taken in order from a shared counter (for the experts: each
        # one's rows split by q4_split_row, its gate and up rows MOE_IN_ROWS at a time, then
        # silu * up, the split of its h, its down rows MOE_OUT_ROWS at a time, then the
        # weighting). A unit waits for the units it needs, which a running thread has already
        # taken, so a thread never waits for one that has not started. Every (token, row) goes
        # through the same operations whatever thread or unit computes it. The waits are plain
        # spins: an x86 `pause` in a KVM guest exits to the host (pause-loop exiting) and the
        # waiter stalls.
        j, idle = job, 0
        if serve:
            atomic_add(board, 2, 1)
        while True:
            if serve:
                if atomic_load(board, 1) != 0:
                    break
                if atomic_load(board, 0) <= j:
                    idle += 1
                    if idle > SPIN_LIMIT:
                        break
                    if idle % YIELD_EVERY == 0:
                        yield_cpu()
                    continue  # a plain spin (see above)
                idle = 0
            else:
                atomic_add(board, 0, 1)  # published: helpers may start on it
            job_d = board[BOARD_HEAD + j * JOB_LEN : BOARD_HEAD + (j + 1) * JOB_LEN]  # its descriptor
            if job_d[0] == JOB_MOE_Q4 or job_d[0] == JOB_MOE_I8:
                D, R, E, n_work, I, A = job_d[3], job_d[5], job_d[6], job_d[8], job_d[9], job_d[10]
                act, params = job_d[13], nb.carray(f32_at(job_d[14]), (2,))
                # JOB_MOE_I8: the same units, the activations quantised (intdot.quantize_row)
                # where JOB_MOE_Q4 splits them, the integer dot products (the weights in tiles of
                # 16 rows, I8_IN_ROWS / I8_OUT_ROWS rows a unit) where it has q4_matmul
                integer = job_d[0] == JOB_MOE_I8
                bits, gw, gd = (job_d[15], job_d[16], job_d[17]) if integer else (4, g, g)  # gate/up's group, down's
                if integer:
                    n_ints, n_need = moe_i8_sizes(R, E, D, I)
                else:
                    n_ints, n_need = moe_q4_sizes(R, E, D, I, g)
                x_all, rows, starts, addrs, ctl, work, wts, ys = expert_job(job_d, n_ints)
                check_expert_job(rows, starts, ys, D % gw == 0 and I % gd == 0 and (not integer or gw % 32 + gd % 32 + I % 16 + D % 16 == 0)
                                 and f16_lut.shape[0] == 65536 and n_work >= n_need and (bits == 4 or bits == 8))
                # work, carved as moe_q4_sizes (moe_i8_sizes) counts it: xe/xq, xd/xc, xs/xd; he/hq, hd/hc, hs/hd
                # (JOB_MOE_I8: xe holds x's records, he h's: intdot.quantize_row; xd, xs, hd, hs empty)
                xe, o = carve(work, 0, R, record_len(D) // 4 if integer else D // 2)
                xd, o = carve(work, o, R, 0 if integer else D // 2)
                xs, o = carve(work, o, R, 0 if integer else D // g)
                h, o = carve(work, o, R, I)
                u, o = carve(work, o, R, I)
                he, o = carve(work, o, R, record_len(I) // 4 if integer else I // 2)
                hd, o = carve(work, o, R, 0 if integer else I // 2)
                hs, o = carve(work, o, R, 0 if integer else I // g)
                out, o = carve(work, o, R, D)
                xr = nb.carray(i8_at(xe.ctypes.data), (R, record_len(D) if integer else 0))
                hr = nb.carray(i8_at(he.ctypes.data), (R, record_len(I) if integer else 0))
                qd = D // 2 if bits == 4 else D  # bytes of a gate / up row, of a down row
                qi = I // 2 if bits == 4 else I
                in_rows, out_rows = (I8_IN_ROWS, I8_OUT_ROWS) if integer else (MOE_IN_ROWS, MOE_OUT_ROWS)
                n_in, n_out = (I + in_rows - 1) // in_rows, (D + out_rows - 1) // out_rows
                # units: [0, E) x split; then E * n_in gate/up; then E h split; then E * n_out down.
                # ctl[0]: next unit; ctl[1]: units done; ctl[2 + e]: e's x split; ctl[2 + E + e]: its
                # gate/up units done; ctl[2 + 2 E + e]: its h split
                u_in, u_h, u_out = E, E + E * n_in, 2 * E + E * n_in
                total = u_out + E * n_out
                while True:
                    k = atomic_add(ctl, 0, 1)
                    if k >= total:
                        break
                    if k < u_in:
                        for i in range(starts[k], starts[k + 1]):
                            if integer:
                                quantize_row(x_all, rows[i] // A, bits, xr, i)
                            else:
                                q4_split_row(x_all, rows[i] // A, g, xe, xd, xs, i)
                        atomic_add(ctl, 2 + k, 1)
                    elif k < u_h:
                        e, c = (k - u_in) // n_in, (k - u_in) % n_in
                        while atomic_load(ctl, 2 + e) == 0:
                            pass
                        lo, hi = starts[e], starts[e + 1]
                        n_lo, n_hi = c * in_rows, min(I, (c + 1) * in_rows)
                        if not integer:
                            gq, gs = nb.carray(u8_at(addrs[e, 0]), (I, qd)), nb.carray(u16_at(addrs[e, 1]), (I, D // gw))
                            uq, us = nb.carray(u8_at(addrs[e, 2]), (I, qd)), nb.carray(u16_at(addrs[e, 3]), (I, D // gw))
                            q4_matmul(xe, xd, xs, gq, gs, f16_lut, h, half, lo, hi, n_lo, n_hi)
                            q4_matmul(xe, xd, xs, uq, us, f16_lut, u, half, lo, hi, n_lo, n_hi)
                        else:  # the weights in tiles of 16 rows (intdot.retile)
                            gq, gs = nb.carray(u8_at(addrs[e, 0]), (I // 16, 16 * qd)), nb.carray(u16_at(addrs[e, 1]), (I // 16, 16 * (D // gw)))
                            uq, us = nb.carray(u8_at(addrs[e, 2]), (I // 16, 16 * qd)), nb.carray(u16_at(addrs[e, 3]), (I // 16, 16 * (D // gw)))
                            if bits == 4:
                                idot(xr, gq, gs, h, gw, D, 4, path, lo, hi, n_lo // 16, n_hi // 16)
                                idot(xr, uq, us, u, gw, D, 4, path, lo, hi, n_lo // 16, n_hi // 16)
                            else:
                                idot(xr, gq, gs, h, gw, D, 8, path, lo, hi, n_lo // 16, n_hi // 16)
                                idot(xr, uq, us, u, gw, D, 8, path, lo, hi, n_lo // 16, n_hi // 16)
                        activate(act, h, u, params, addrs[e, 6], addrs[e, 7], I, lo, hi, n_lo, n_hi)
                        atomic_add(ctl, 2 + E + e, 1)
                    elif k < u_out:
                        e = k - u_h
                        while atomic_load(ctl, 2 + E + e) < n_in:
                            pass
                        for i in range(starts[e], starts[e + 1]):
                            if integer:
                                quantize_row(h, i, bits, hr, i)
                            else:
                                q4_split_row(h, i, g, he, hd, hs, i)
                        atomic_add(ctl, 2 + 2 * E + e, 1)
                    else:
                        e, c = (k - u_out) // n_out, (k - u_out) % n_out
                        while atomic_load(ctl, 2 + 2 * E + e) == 0:
                            pass
                        lo, hi = starts[e], starts[e + 1]
                        d_lo, d_hi = c * out_rows, min(D, (c + 1) * out_rows)
                        if not integer:
                            dq, ds = nb.carray(u8_at(addrs[e, 4]), (D, qi)), nb.carray(u16_at(addrs[e, 5]), (D, I // gd))
                            q4_matmul(he, hd, hs, dq, ds, f16_lut, out, half, lo, hi, d_lo, d_hi)
                        else:
                            dq, ds = nb.carray(u8_at(addrs[e, 4]), (D // 16, 16 * qi)), nb.carray(u16_at(addrs[e, 5]), (D // 16, 16 * (I // gd)))
                            if bits == 4:
                                idot(hr, dq, ds, out, gd, I, 4, path, lo, hi, d_lo // 16, d_hi // 16)
                            else:
                                idot(hr, dq, ds, out, gd, I, 8, path, lo, hi, d_lo // 16, d_hi // 16)
                        weigh(out, addrs[e, 8], rows, wts, ys, starts[e], starts[e + 1], d_lo, d_hi)
                    atomic_add(ctl, 1, 1)
                    if serve:
                        atomic_add(board, 3, 1)
                while atomic_load(ctl, 1) < total:  # the units the other threads are still on
                    pass
            elif job_d[0] == JOB_MOE_TOK:
                D, R, E, n_work, I, A = job_d[3], job_d[5], job_d[6], job_d[8], job_d[9], job_d[10]
                act, params = job_d[13], nb.carray(f32_at(job_d[14]), (2,))
                wkind, table = job_d[15], nb.carray(f32_at(job_d[16]), (N_TABLE,))
                bn, bk, bn_d, bk_d = job_d[17], job_d[18], job_d[19], job_d[20]
                n_ints, n_need = moe_tok_sizes(R, E, D, I)
                x_all, rows, starts, addrs, ctl, work, wts, ys = expert_job(job_d, n_ints)
                check_expert_job(rows, starts, ys, f16_lut.shape[0] == 65536 and n_work >= n_need)
                xg, o = carve(work, 0, R, D)  # each expert's tokens, gathered
                h, o = carve(work, o, R, I)
                u, o = carve(work, o, R, I)
                out, o = carve(work, o, R, D)
                n_in, n_out = (I + MOE_IN_ROWS - 1) // MOE_IN_ROWS, (D + MOE_OUT_ROWS - 1) // MOE_OUT_ROWS
                # units: [0, E) gather; then E * n_in gate/up; then E * n_out down. ctl[0]: next unit;
                # ctl[1]: units done; ctl[2 + e]: e's gather; ctl[2 + E + e]: its gate/up units done
                u_in, u_out = E, E + E * n_in
                total = u_out + E * n_out
                wb_in, wb_out = rows_aligned(ROW_BLOCK, D), rows_aligned(ROW_BLOCK, I)  # this thread's widened rows
                while True:
                    k = atomic_add(ctl, 0, 1)
                    if k >= total:
                        break
                    if k < u_in:
                        for i in range(starts[k], starts[k + 1]):
                            xg[i] = x_all[rows[i] // A]
                        atomic_add(ctl, 2 + k, 1)
                    elif k < u_out:
                        e, c = (k - u_in) // n_in, (k - u_in) % n_in
                        while atomic_load(ctl, 2 + e) == 0:
                            pass
                        lo, hi = starts[e], starts[e + 1]
                        n_lo, n_hi = c * MOE_IN_ROWS, min(I, (c + 1) * MOE_IN_ROWS)
                        for m in range(2):  # gate into h, up into u
                            qa, sa, dst = addrs[e, 2 * m], addrs[e, 2 * m + 1], h if m == 0 else u
                            if wkind == W_F32:
                                tiles(xg[lo:hi], nb.carray(f32_at(qa), (I, D)), n_lo, n_hi, dst[lo:hi], 0)
                                continue
                            if wkind == W_BF16 and hi - lo <= BF16_DIRECT_TOKENS:  # a few tokens: widened in registers
                                tiles(xg[lo:hi], nb.carray(u16_at(qa), (I, D)), n_lo, n_hi, dst[lo:hi], 0)
                                continue
                            for n0 in range(n_lo, n_hi, ROW_BLOCK):
                                nr = min(ROW_BLOCK, n_hi - n0)
                                widen_rows(wkind, qa, sa, I, D, bn, bk, table, f16_lut, n0, nr, wb_in)
                                tiles(xg[lo:hi], wb_in, 0, nr, dst[lo:hi], n0)
                        activate(act, h, u, params, addrs[e, 6], addrs[e, 7], I, lo, hi, n_lo, n_hi)
                        atomic_add(ctl, 2 + E + e, 1)
                    else:
                        e, c = (k - u_out) // n_out, (k - u_out) % n_out
                        while atomic_load(ctl, 2 + E + e) < n_in:
                            pass
                        lo, hi = starts[e], starts[e + 1]
                        d_lo, d_hi = c * MOE_OUT_ROWS, min(D, (c + 1) * MOE_OUT_ROWS)
                        qa, sa = addrs[e, 4], addrs[e, 5]
                        if wkind == W_F32:
                            tiles(h[lo:hi], nb.carray(f32_at(qa), (D, I)), d_lo, d_hi, out[lo:hi], 0)
                        elif wkind == W_BF16 and hi - lo <= BF16_DIRECT_TOKENS:
                            tiles(h[lo:hi], nb.carray(u16_at(qa), (D, I)), d_lo, d_hi, out[lo:hi], 0)
                        else:
                            for n0 in range(d_lo, d_hi, ROW_BLOCK):
                                nr = min(ROW_BLOCK, d_hi - n0)
                                widen_rows(wkind, qa, sa, D, I, bn_d, bk_d, table, f16_lut, n0, nr, wb_out)
                                tiles(h[lo:hi], wb_out, 0, nr, out[lo:hi], n0)
                        weigh(out, addrs[e, 8], rows, wts, ys, lo, hi, d_lo, d_hi)
                    atomic_add(ctl, 1, 1)
                    if serve:
                        atomic_add(board, 3, 1)
                while atomic_load(ctl, 1) < total:  # the units the other threads are still on
                    pass
            else:
                T, D, N = job_d[2], job_d[3], job_d[5]
                x, ctl = nb.carray(f32_at(job_d[1]), (T, D if job_d[0] != JOB_I8 else 0)), nb.carray(i64_at(job_d[7]), (2,))
                out = nb.carray(f32_at(job_d[6]), (T, N))
                per = I8_IN_ROWS if job_d[0] == JOB_I8 else ROWS_PER_TASK  # (JOB_I8: whole tiles of 16 rows)
                total = (N + per - 1) // per
                while True:
                    c = atomic_add(ctl, 0, 1)
                    if c >= total:
                        break
                    r_hi = min(N, (c + 1) * per)
                    if job_d[0] == JOB_I8:  # (x is the quantised activations' records; the weights in tiles)
                        xr = nb.carray(i8_at(job_d[1]), (T, record_len(D)))
                        gw, qd = job_d[12], D // 2 if job_d[8] == 4 else D
                        n_tiles = (N + 15) // 16  # (padded to whole tiles: intdot.arranged)
                        q, sc = nb.carray(u8_at(job_d[4]), (n_tiles, 16 * qd)), nb.carray(u16_at(job_d[9]), (n_tiles, 16 * (D // gw)))
                        if job_d[8] == 4:
                            idot(xr, q, sc, out, gw, D, 4, path, 0, T, c * per // 16, (r_hi + 15) // 16)
                        else:
                            idot(xr, q, sc, out, gw, D, 8, path, 0, T, c * per // 16, (r_hi + 15) // 16)
                    elif job_d[0] == JOB_U16:
                        matmul_u16_rows(x, nb.carray(u16_at(job_d[4]), (N, D)), job_d[8] != 0, f16_lut, out, c * ROWS_PER_TASK, r_hi)
                    else:
                        tiles(x, nb.carray(f32_at(job_d[4]), (N, D)), c * ROWS_PER_TASK, r_hi, out, 0)
                    atomic_add(ctl, 1, 1)
                    if serve:
                        atomic_add(board, 3, 1)
                while atomic_load(ctl, 1) < total:  # the units the other threads are still on
                    pass
            if not serve:
                return
            j += 1
        atomic_add(board, 2, -1)

    return crew_g


CREW = {g: _make_crew(g, intdot.PATH) for g in (32, 64, 128)}  # group size -> the crew's kernel


_COMPUTE_POOL = None  # threads that compute a batch's experts side by side (set_threads)
_CREW_POOL = None  # threads that join a Crew (set_threads)
_N_HELPERS = 0


def set_threads(n: int) -> None:
    """Use n threads for the experts of a batch (the caller's thread is one of them) and for
    the parallel dense kernels."""
    global _COMPUTE_POOL, _CREW_POOL, _N_HELPERS
    from concurrent.futures import ThreadPoolExecutor

    import numba

    n = max(1, min(n, numba.config.NUMBA_NUM_THREADS))
    numba.set_num_threads(n)
    for pool in (_COMPUTE_POOL, _CREW_POOL):
        if pool is not None:
            pool.shutdown()
    _COMPUTE_POOL = ThreadPoolExecutor(n - 1, thread_name_prefix="colibri-compute") if n > 1 else None
    _CREW_POOL = ThreadPoolExecutor(n - 1, thread_name_prefix="colibri-crew") if n > 1 else None
    _N_HELPERS = n - 1


def run_shared(items: list, fn) -> None:
    """fn(item) for every item, on this thread and the compute threads, each taking the next
    item until none is left."""
    todo = iter(items)
    lock = threading.Lock()

    def work():
        while True:
            with lock:
                item = next(todo, None)
            if item is None:
                return
            fn(item)

    helpers = [_COMPUTE_POOL.submit(work) for _ in range(_N_HELPERS)]
    work()
    for f in helpers:
        f.result()


class Crew:
    """The threads that share a forward step's parallel work (the CREW kernel): this thread and,
    with `share`, the crew threads, which stay in the kernel between jobs (spinning, so
    nothing has to wake them: waking a CPU that has gone idle takes 0.1-0.6 ms here, a layer's
    experts ~2 ms). Each job (`experts`, `matmul`) is published on the board and done by
    whoever is there; a helper that comes late finds it done. A helper that waited too long
    leaves, and the next job calls it back. `close` ends the step: the helpers leave. A crew
    without helpers (`share` False) is the same code on this thread alone."""

    def __init__(self, g: int, share: bool, max_jobs: int = 512):
        self.g, self.kernel, self.share = g, CREW[g], share and _CREW_POOL is not None
        self.MAX_JOBS = max_jobs  # a step's jobs: ~5 per layer
        self.board = np.zeros(BOARD_HEAD + JOB_LEN * max_jobs, np.int64)
        self.keep: list = []  # every array a descriptor points at, alive while a helper may read it
        self.jobs = 0
        self.helpers: list = []  # their futures
        self.work = np.empty(0, np.float32)  # the expert jobs' scratch
        self._summon()

    def _summon(self) -> None:
        if not self.share or self.jobs == self.MAX_JOBS:
            return
        self.board[1] = 0  # open (again)
        # called back only once every helper has left; all of them in the kernel (board[2]) is
        # the common case, known without asking each future (~2 us apiece on a decode step)
        if self.board[2] < _N_HELPERS and all(f.done() for f in self.helpers):
            self.helpers = [_CREW_POOL.submit(_serve, self.kernel, self.board, self.jobs, self.keep) for _ in range(_N_HELPERS)]

    def _run(self, describe, args: tuple, keep: tuple) -> None:
        # publish a job (its descriptor written by `describe(board, job, *args)`) and do it
        if self.jobs == self.MAX_JOBS:  # the board is full: the further jobs on a board of their own
            Crew(self.g, share=False, max_jobs=1)._run(describe, args, keep)
            return
        self._summon()
        self.keep.append(keep)
        describe(self.board, self.jobs, *args)
        self.jobs += 1
        self.kernel(self.board, self.jobs - 1, f16_lut(), 0)

    def experts(self, x: np.ndarray, rows: np.ndarray, starts: np.ndarray, A: int, wts: np.ndarray, experts: list,
                ys: np.ndarray, act: tuple | None = None) -> None:
        # int4 experts of one shape on the decode path, for some rows of a step: ys[r] = wts[r] *
        # expert e(x[r // A]) for r in rows[starts[e]:starts[e + 1]]; x [T, D] f32, rows [R] int64,
        # wts [T * A] f32, ys [T * A, D] f32; experts: (gate, up, down), with their biases
        # (gate, up, down; storage precision) when act is gpt-oss's (alpha, limit)
        facts = [int4_of(e) for e in experts]  # (group, layouts, addresses), kept on the cache's experts
        first = facts[0]
        if (first is None or any(f is None or f[1] is not first[1] for f in facts)
                or any(len(e) != (6 if act else 3) for e in experts)):
            raise ValueError("int4 experts: the weight, activation and output shapes do not match")
        E = len(experts)
        addrs = np.zeros((E, N_ADDRS), np.int64)
        addrs[:, :6] = np.frombuffer(b"".join([f[2] for f in facts]), np.int64).reshape(E, 6)
        biases = _biases(experts, first[1][0][2][0], x.shape[1], addrs) if act else []
        self.experts_at(x, rows, starts, A, wts, addrs, first[0], first[1], ys, act, (experts, biases))

    def experts_i8(self, x: np.ndarray, rows: np.ndarray, starts: np.ndarray, A: int, wts: np.ndarray,
                   experts: list, ys: np.ndarray, act: tuple | None = None) -> None:
        # int8 or int4 experts of one shape (intdot.takes each matrix), their bytes in tiles
        # (intdot.arrange_expert), on int8 activations (formats/intdot.py), decode and prompt
        # rows alike; arguments as experts'
        gate = experts[0][0]
        layouts = tuple(w.layout for w in experts[0][:3])
        if (any(tuple(w.layout for w in e[:3]) != layouts for e in experts) or gate.kind not in ("int8", "int4")
                or any(len(e) != (6 if act else 3) for e in experts)):
            raise ValueError("experts: the weight, activation and output shapes do not match")
        E = len(experts)
        addrs = np.zeros((E, N_ADDRS), np.int64)
        addrs[:, :6] = np.array([a for e in experts for w in e[:3] for a in w.addresses], np.int64).reshape(E, 6)
        biases = _biases(experts, gate.shape[0], x.shape[1], addrs) if act else []
        self.experts_at(x, rows, starts, A, wts, addrs, gate.group_size, layouts, ys, act, (experts, biases),
                        bits=8 if gate.kind == "int8" else 4)

    def experts_at(self, x: np.ndarray, rows: np.ndarray, starts: np.ndarray, A: int, wts: np.ndarray,
                   addrs: np.ndarray, g: int, layouts: tuple, ys: np.ndarray, act: tuple | None = None,
                   keep: tuple = (), bits: int | None = None) -> None:
        # experts' job as `experts` computes it, the experts given by address: addrs [E, 6 or
        # N_ADDRS] int64 (gate q, scales, up q, scales, down q, scales, then the biases' or 0)
        # of int4 matrices of group g whose layouts are `layouts` (QuantWeight.layout of gate,
        # up, down; every expert's); what `keep` holds stays alive through the job. The cache
        # hands a resident step's addresses out this way (ExpertCache.int4_hits): no view or
        # object per expert on the decode path. With bits (8 or 4), experts of that width on
        # int8 activations (JOB_MOE_I8), any group that is a multiple of 32
        E, R, D = len(addrs), len(rows), x.shape[1]
        gate = layouts[0]
        I = gate[2][0]
        kind, per = ("int8", 1) if bits == 8 else ("int4", 2)
        gd = g if bits is None else layouts[2][1]  # down's group (int8's one scale a row: gate's is D, down's I)
        if ((g != self.g if bits is None else (g % 32 or gd % 32 or D % g or I % gd or I % 16 or D % 16))
                or gate != (kind, g, (I, D // per), (I, D // g)) or layouts[1] != gate
                or layouts[2] != (kind, gd, (D, I // per), (D, I // gd)) or x.dtype != np.float32
                or ys.dtype != np.float32 or wts.dtype != np.float32 or ys.shape != (x.shape[0] * A, D)
                or wts.shape != (x.shape[0] * A,) or addrs.shape[1] not in (6, N_ADDRS) or len(starts) != E + 1
                or not (x.flags.c_contiguous and ys.flags.c_contiguous and wts.flags.c_contiguous)):
            raise ValueError(f"{kind} experts: the weight, activation and output shapes do not match")
        sizes = moe_q4_sizes.py_func(R, E, D, I, g) if bits is None else moe_i8_sizes.py_func(R, E, D, I)
        n_ints, n_work = sizes  # (the same code, without a kernel call's checks)
        ints = np.zeros(n_ints, np.int64)  # new for each job (a helper late for a job still reads its counters)
        rows_, starts_, addrs_, _ = moe_q4_ints.py_func(ints, R, E)  # views of ints
        rows_[:], starts_[:] = rows, starts
        addrs_[:, : addrs.shape[1]] = addrs
        params = np.array(act or (0.0, 0.0), np.float32)
        if self.work.size < n_work:  # scratch only units touch: kept from job to job (a job is done when _run returns)
            self.work = empty_aligned(max(n_work, 2 * self.work.size))
        args = (x, ints, R, E, self.work, n_work, I, A, wts, ys, ACT_CLAMPED if act else ACT_SILU, params)
        if bits is None:
            self._run(describe_moe_q4, args, (x, ints, self.work, wts, ys, keep, params))
        else:
            self._run(describe_moe_i8, args + (bits, g, gd), (x, ints, self.work, wts, ys, keep, params))

    def experts_tok(self, x: np.ndarray, rows: np.ndarray, starts: np.ndarray, A: int, wts: np.ndarray,
                    experts: list, ys: np.ndarray, act: tuple | None = None) -> None:
        # experts of one shape and kind (tok_kind), for some rows of a step, as the prompt path
        # computes them (rows widened to float32, tiles with the expert's tokens): ys[r] = wts[r]
        # * expert e(x[r // A]) for r in rows[starts[e]:starts[e + 1]]; arguments as experts'
        gate, up, down = experts[0][:3]
        I, D = gate.shape
        wkind = tok_kind(gate, up, down)
        sig = _signature(gate)
        bad = (wkind is None or gate.shape != up.shape or down.shape != (D, I) or x.shape[1] != D
               or x.dtype != np.float32 or ys.dtype != np.float32 or wts.dtype != np.float32
               or ys.shape != (x.shape[0] * A, D) or wts.shape != (x.shape[0] * A,)
               or not (x.flags.c_contiguous and ys.flags.c_contiguous and wts.flags.c_contiguous)
               or any(len(e) != (6 if act else 3) for e in experts))
        if bad or any((_signature(gt), _signature(u), _signature(dn)) != (sig, sig, _signature(down))
                      for gt, u, dn, *_ in experts):
            raise ValueError("experts: the weight, activation and output shapes do not match")
        E, R = len(experts), len(rows)
        n_ints, n_work = moe_tok_sizes(R, E, D, I)
        ints = np.zeros(n_ints, np.int64)
        rows_, starts_, addrs, _ = moe_q4_ints(ints, R, E)
        rows_[:], starts_[:] = rows, starts
        addrs[:, :6] = np.array([a for e in experts for w in e[:3] for a in _addresses(w)], np.int64).reshape(E, 6)
        biases = _biases(experts, I, D, addrs) if act else []
        params = np.array(act or (0.0, 0.0), np.float32)
        table = np.zeros(N_TABLE, np.float32)
        blocks = (1, 1, 1, 1)
        if isinstance(gate, QuantWeight):
            blocks = (gate.row_block, gate.group_size, down.row_block, down.group_size)
            fmt = FORMATS[gate.kind]
            if fmt.values is not None:  # FP8's 256 values; MXFP4's 16, then its scales' 256
                table[: len(fmt.values)] = fmt.values
            if fmt.scale_values is not None:
                table[16:] = fmt.scale_values
        if self.work.size < n_work:
            self.work = empty_aligned(max(n_work, 2 * self.work.size))
        work = self.work[:n_work]
        self._run(describe_moe_tok, (x, ints, R, E, work, I, A, wts, ys, ACT_CLAMPED if act else ACT_SILU, params,
                                     wkind, blocks, table),
                  (x, ints, self.work, wts, ys, experts, biases, params, table))

    def matmul(self, x: np.ndarray, w: np.ndarray, out: np.ndarray) -> None:
        # out [T, N] = x [T, D] f32 @ w [N, D].T, w in storage precision (f32, f16, bf16 as
        # uint16): as matmul_f32 and matmul_u16
        T, D = x.shape
        if (w.ndim != 2 or w.dtype not in (np.float32, np.float16, np.uint16) or w.shape[1] != D or out.shape != (T, w.shape[0]) or x.dtype != np.float32
                or out.dtype != np.float32 or not (x.flags.c_contiguous and w.flags.c_contiguous and out.flags.c_contiguous)):
            raise ValueError("matmul: weight, activation and output shapes do not match")
        if T > 1:  # the tiles read a prompt's rows many times over (a decode row once)
            x = aligned(x)
        kind = JOB_F32 if w.dtype == np.float32 else JOB_U16
        ctl = np.zeros(2, np.int64)
        bits = w.view(np.uint16) if w.dtype == np.float16 else w  # (numba takes no float16 arrays; the kernel reads bits)
        self._run(describe_matmul, (kind, x, bits, out, ctl, w.dtype == np.uint16), (x, w, out, ctl))

    def matmul_i8(self, x: np.ndarray, w: QuantWeight, out: np.ndarray) -> None:
        # out [T, N] = x [T, D] f32 @ w.T for an int8 / int4 QuantWeight w [N, D] in tiles
        # (intdot.arranged) on int8 activations: as formats/intdot.py's linear computes it
        T, D = x.shape
        if (w.kind not in ("int8", "int4") or not w.integer or w.shape != (out.shape[1], D) or out.shape[0] != T
                or D % 32
                or w.group_size % 32 or D % w.group_size or out.dtype != np.float32 or not out.flags.c_contiguous
                or not (w.q.flags.c_contiguous and w.scales.flags.c_contiguous)):
            raise ValueError("matmul: weight, activation and output shapes do not match")
        bits = 8 if w.kind == "int8" else 4
        rec = np.empty((T, intdot.record_len(D)), np.int8)
        intdot.quantize_rows(np.ascontiguousarray(x, dtype=np.float32), bits, rec)
        ctl = np.zeros(2, np.int64)
        q, scales = intdot.tiles(w)
        self._run(describe_matmul_i8, (rec, D, q, scales, w.group_size, bits, out, ctl), (rec, q, scales, out, ctl))

    def close(self) -> None:
        # the helpers leave (and are called back by the next job, if any: `close` also parks
        # them while other threads need the CPUs)
        self.board[1] = 1


def tok_kind(gate, up, down) -> int | None:
    """The JOB_MOE_TOK weight kind of an expert's three matrices, None when the job cannot
    take them (kinds that differ, a layout it does not know)."""
    kinds = set()
    for w in (gate, up, down):
        if isinstance(w, QuantWeight) and w.q.flags.c_contiguous and w.scales.flags.c_contiguous:
            # (GGUF's block formats are not: their 13 decoders in this kernel made every process
            # ~15 MB larger, GGUF or not; their experts go one by one, by engine/formats/ggml.py)
            kinds.add(FORMATS[w.kind].code if w.kind in FORMATS and not FORMATS[w.kind].block else -1)
        elif isinstance(w, np.ndarray) and w.ndim == 2 and w.flags.c_contiguous:
            kinds.add(DTYPE_CODES.get(w.dtype, -1))
        else:
            return None
    if len(kinds) != 1 or -1 in kinds:
        return None
    return kinds.pop()


def _signature(w) -> tuple:
    # what must be the same for every expert of a job (the kernel trusts the shapes)
    if isinstance(w, QuantWeight):
        return w.layout + (w.row_block,)
    return w.dtype, w.shape


def _addresses(w) -> tuple[int, int]:
    return w.addresses if isinstance(w, QuantWeight) else (w.ctypes.data, 0)


def _biases(experts: list, I: int, D: int, addrs: np.ndarray) -> list:
    # each expert's gate, up and down biases (e[3:]) in float32, their addresses into addrs[:, 6:9];
    # the arrays, to keep alive with the job
    biases = []
    for k, e in enumerate(experts):
        for j, (b, n) in enumerate(zip(e[3:], (I, I, D))):
            b = np.ascontiguousarray(bf16_to_f32(b) if b.dtype == np.uint16 else b, dtype=np.float32)
            if b.shape != (n,):
                raise ValueError("experts: a bias does not match its matrix")
            biases.append(b)
            addrs[k, 6 + j] = b.ctypes.data
    return biases


_SESSION = threading.local()  # .crew: the crew of the forward step this thread is in; .prompt_rows: its rows'


def session() -> "Crew | None":
    """The crew of the forward step this thread is in, if any."""
    return getattr(_SESSION, "crew", None)


def prompt_rows(n: int) -> "np.ndarray | None":
    """Which of the n rows of the forward step this thread is in are a prompt's (a sequence
    with several tokens in the step), as bools; None outside a step, or for n other than
    its rows (a family's matrices over other rows than the step's tokens)."""
    rows = getattr(_SESSION, "prompt_rows", None)
    return rows if rows is not None and len(rows) == n else None


def threads_set() -> bool:
    """Whether set_threads gave this process compute threads beside its own."""
    return _COMPUTE_POOL is not None


@contextmanager
def crew_session(g: int | None, rows: "np.ndarray | None" = None):
    """A forward step's crew (for int4 experts of group g, or None): the experts and the big
    matrices of the step run on it. rows: which of the step's rows are a prompt's (prompt_rows)."""
    crew = Crew(g or 64, share=True)
    before = getattr(_SESSION, "crew", None), getattr(_SESSION, "prompt_rows", None)
    _SESSION.crew, _SESSION.prompt_rows = crew, rows
    try:
        yield crew
    finally:
        _SESSION.crew, _SESSION.prompt_rows = before
        crew.close()


def _serve(kernel, board: np.ndarray, job: int, keep: list) -> None:
    # a crew thread: the jobs of `board` from `job` on as they come (`keep` holds what they point at)
    kernel(board, job, f16_lut(), 1)
