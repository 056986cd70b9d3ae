"""The crew's job board: how a forward step's parallel work is laid out for the threads that
share it (crew.py), in one int64 array. The board's head, each job's descriptor and its
kinds; for an expert job its ints and scratch (`moe_q4_sizes` / `moe_q4_ints`,
`moe_tok_sizes`), which both the Python side that fills a job and the kernel that reads it
call; the `describe_*` writers; and the pieces of an expert job the kernel inlines: the
weights widened by their format's one code (`widen_rows`, storage/formats), the activation,
the weighting. Laid out here and nowhere else.
"""

import numba as nb
import numpy as np

from ..storage.experts import FORMATS, PLAIN_CODES
from .atomics import f32_at, i8_at, i64_at, u8_at, u16_at
from .formats.fp8 import f8_rows
from .formats.int4 import q4_rows_32, q4_rows_64, q4_rows_128
from .formats.int8 import q8_rows
from .formats.intdot import record_len
from .formats.mxfp4 import mx4_rows
from .ir_rows import clamped_rows, silu_mul_rows
from .jit import JIT
from .kernels import CARVE_SLACK, u16_rows

# Crew's board (crew_g): published jobs, the closed flag, helpers in, units the helpers
# did; then each job's descriptor
BOARD_HEAD, JOB_LEN = 4, 21
JOB_MOE_Q4, JOB_U16, JOB_F32, JOB_MOE_TOK, JOB_MOE_I8, JOB_I8 = 1, 2, 3, 4, 5, 6  # a job's kind
# gate/up rows, down rows a unit of crew_g takes (~144 KiB, ~100 KiB of int4 at 2048 x 768):
# whole ROW_BLOCKs, so that the prompt path's tiles are whole
MOE_IN_ROWS, MOE_OUT_ROWS = 72, 264
I8_IN_ROWS, I8_OUT_ROWS = 64, 256  # the integer job's (JOB_MOE_I8): whole tiles of 16 rows (formats/intdot.py)


N_ADDRS = 9  # per expert: gate q, scales, up q, scales, down q, scales, then its biases (0: none)
ACT_SILU, ACT_CLAMPED = 0, 1  # an expert job's activation: SwiGLU; gpt-oss's clamped one (params alpha, limit)
# a JOB_MOE_TOK job's weights, by their format's one code (storage/formats): what widen_rows
# turns into float32 rows
W_BF16, W_F16, W_F32 = PLAIN_CODES["bf16"], PLAIN_CODES["f16"], PLAIN_CODES["f32"]
W_INT8, W_INT4, W_MXFP4 = FORMATS["int8"].code, FORMATS["int4"].code, FORMATS["mxfp4"].code
W_E4M3, W_E5M2 = FORMATS["fp8_e4m3"].code, FORMATS["fp8_e5m2"].code
DTYPE_CODES = {np.dtype(np.uint16): W_BF16, np.dtype(np.float16): W_F16, np.dtype(np.float32): W_F32}
N_TABLE = 16 + 256  # a JOB_MOE_TOK job's value table: FP8's 256 values, or MXFP4's 16 (e2m1) then 256 (e8m0)


@nb.njit(**JIT)
def moe_q4_sizes(R, E, D, I, g):
    # (ints, work) lengths of a JOB_MOE_Q4 job of E experts over R rows: ints = rows [R],
    # starts [E + 1], addrs [E, N_ADDRS], ctl [2 + 3 E]; work = xe, xd [R, D/2], xs [R, D/g],
    # h, u [R, I], he, hd [R, I/2], hs [R, I/g], out [R, D] (f32)
    return R + (E + 1) + N_ADDRS * E + (2 + 3 * E), R * (2 * D + D // g + 3 * I + I // g) + 9 * CARVE_SLACK


@nb.njit(**JIT)
def moe_i8_sizes(R, E, D, I):
    # (ints, work) lengths of a JOB_MOE_I8 job (ints as JOB_MOE_Q4's); work = x's records [R,
    # record_len(D)] int8, h, u [R, I], h's records [R, record_len(I)] int8, out [R, D] (f32
    # unless said; the records in float32's room, a quarter)
    return (R + (E + 1) + N_ADDRS * E + (2 + 3 * E),
            R * (record_len(D) // 4 + 2 * I + record_len(I) // 4 + D) + 9 * CARVE_SLACK)


@nb.njit(**JIT)
def moe_q4_ints(ints, R, E):
    # a JOB_MOE_Q4 job's ints -> views rows [R], starts [E + 1], addrs [E, N_ADDRS], ctl [2 + 3 E]
    a = R + E + 1
    return ints[:R], ints[R:a], ints[a : a + N_ADDRS * E].reshape(E, N_ADDRS), ints[a + N_ADDRS * E :]


@nb.njit(**JIT)
def describe_moe_q4(board, job, x_all, ints, R, E, work, n_work, I, A, wts, ys, act, params):
    # job `job`'s JOB_MOE_Q4 descriptor (see crew_g) onto the board, from the arrays themselves
    d = board[BOARD_HEAD + job * JOB_LEN : BOARD_HEAD + (job + 1) * JOB_LEN]
    d[0], d[1], d[2], d[3] = JOB_MOE_Q4, x_all.ctypes.data, x_all.shape[0], x_all.shape[1]
    d[4], d[5], d[6], d[7], d[8] = ints.ctypes.data, R, E, work.ctypes.data, n_work
    d[9], d[10], d[11], d[12] = I, A, wts.ctypes.data, ys.ctypes.data
    d[13], d[14] = act, params.ctypes.data


@nb.njit(**JIT)
def describe_moe_i8(board, job, x_all, ints, R, E, work, n_work, I, A, wts, ys, act, params, bits, g, gd):
    # job `job`'s JOB_MOE_I8 descriptor: JOB_MOE_Q4's fields, then the weights' bits (4, 8), gate
    # and up's group, down's group
    describe_moe_q4(board, job, x_all, ints, R, E, work, n_work, I, A, wts, ys, act, params)
    d = board[BOARD_HEAD + job * JOB_LEN : BOARD_HEAD + (job + 1) * JOB_LEN]
    d[0], d[15], d[16], d[17] = JOB_MOE_I8, bits, g, gd


@nb.njit(**JIT)
def moe_tok_sizes(R, E, D, I):
    # (ints, work) lengths of a JOB_MOE_TOK job of E experts over R rows: ints = rows [R],
    # starts [E + 1], addrs [E, N_ADDRS], ctl [2 + 2 E]; work = xg [R, D], h, u [R, I], out [R, D] (f32)
    return R + (E + 1) + N_ADDRS * E + (2 + 2 * E), R * (2 * D + 2 * I) + 4 * CARVE_SLACK


@nb.njit(**JIT)
def describe_moe_tok(board, job, x_all, ints, R, E, work, I, A, wts, ys, act, params, wkind, blocks, table):
    # job `job`'s JOB_MOE_TOK descriptor (see crew_g) onto the board; blocks: the (rows, columns) a
    # scale covers in gate and up, then in down
    d = board[BOARD_HEAD + job * JOB_LEN : BOARD_HEAD + (job + 1) * JOB_LEN]
    d[0], d[1], d[2], d[3] = JOB_MOE_TOK, x_all.ctypes.data, x_all.shape[0], x_all.shape[1]
    d[4], d[5], d[6], d[7], d[8] = ints.ctypes.data, R, E, work.ctypes.data, work.shape[0]
    d[9], d[10], d[11], d[12] = I, A, wts.ctypes.data, ys.ctypes.data
    d[13], d[14], d[15], d[16] = act, params.ctypes.data, wkind, table.ctypes.data
    d[17], d[18], d[19], d[20] = blocks


@nb.njit(**JIT)
def widen_rows(wkind, qa, sa, N, K, bn, bk, table, f16_lut, n0, nr, wb):
    # wb[:nr] = rows n0 .. n0 + nr of the [N, K] matrix at address qa (its scales at sa) as the
    # float32 values they stand for (exact: as the kind's prompt-path kernel widens them); bk
    # the columns a scale covers (int8, int4: the group size), bn the rows (FP8)
    if wkind == W_BF16 or wkind == W_F16:
        u16_rows(nb.carray(u16_at(qa), (N, K)), wkind == W_BF16, f16_lut, n0, nr, wb)
    elif wkind == W_INT4:
        q, scales = nb.carray(u8_at(qa), (N, K // 2)), nb.carray(u16_at(sa), (N, K // bk))
        if bk == 32:
            q4_rows_32(q, scales, f16_lut, n0, nr, wb)
        elif bk == 64:
            q4_rows_64(q, scales, f16_lut, n0, nr, wb)
        else:
            q4_rows_128(q, scales, f16_lut, n0, nr, wb)
    elif wkind == W_INT8:
        q8_rows(nb.carray(i8_at(qa), (N, K)), nb.carray(u16_at(sa), (N, K // bk)), bk, f16_lut, n0, nr, wb)
    elif wkind == W_E4M3 or wkind == W_E5M2:
        f8_rows(nb.carray(u8_at(qa), (N, K)), nb.carray(f32_at(sa), ((N + bn - 1) // bn, (K + bk - 1) // bk)),
                bn, bk, table[:256], n0, nr, wb)
    else:
        mx4_rows(nb.carray(u8_at(qa), (N, K // 2)), nb.carray(u8_at(sa), (N, K // 32)), table[16:], table[:16],
                 n0, nr, wb)


@nb.njit(**JIT)
def describe_matmul(board, job, kind, x, w, out, ctl, is_bf16):
    # job `job`'s JOB_U16 / JOB_F32 descriptor (see crew_g) onto the board
    d = board[BOARD_HEAD + job * JOB_LEN : BOARD_HEAD + (job + 1) * JOB_LEN]
    d[0], d[1], d[2], d[3] = kind, x.ctypes.data, x.shape[0], x.shape[1]
    d[4], d[5], d[6], d[7], d[8] = w.ctypes.data, w.shape[0], out.ctypes.data, ctl.ctypes.data, is_bf16


@nb.njit(**JIT)
def describe_matmul_i8(board, job, rec, D, q, scales, g, bits, out, ctl):
    # job `job`'s JOB_I8 descriptor: a dense int8 / int4 matrix q [N, D or D/2] in tiles (scales
    # [N, D/g] f16 bits; formats/intdot.py) times quantised activations (intdot.quantize_rows'
    # records rec [T, .] of D columns) into out [T, N]
    d = board[BOARD_HEAD + job * JOB_LEN : BOARD_HEAD + (job + 1) * JOB_LEN]
    d[0], d[1], d[2], d[3] = JOB_I8, rec.ctypes.data, rec.shape[0], D
    d[4], d[5], d[6], d[7], d[8] = q.ctypes.data, out.shape[1], out.ctypes.data, ctl.ctypes.data, bits
    d[9], d[12] = scales.ctypes.data, g


@nb.njit(**JIT)
def expert_job(job_d, n_ints):
    # an expert job's arrays from its descriptor (describe_moe_q4, describe_moe_tok): x_all
    # [T_all, D], rows [R], starts [E + 1], addrs [E, N_ADDRS], ctl, work, wts [T_all * A],
    # ys [T_all * A, D]
    T_all, D, R, E, A = job_d[2], job_d[3], job_d[5], job_d[6], job_d[10]
    rows, starts, addrs, ctl = moe_q4_ints(nb.carray(i64_at(job_d[4]), (n_ints,)), R, E)
    return (nb.carray(f32_at(job_d[1]), (T_all, D)), rows, starts, addrs, ctl, nb.carray(f32_at(job_d[7]), (job_d[8],)),
            nb.carray(f32_at(job_d[11]), (T_all * A,)), nb.carray(f32_at(job_d[12]), (T_all * A, D)))


@nb.njit(**JIT)
def check_expert_job(rows, starts, ys, shapes_ok):
    # what an expert job's kernel checks before it trusts the job
    E, R = starts.shape[0] - 1, rows.shape[0]
    if not shapes_ok or starts[0] != 0 or starts[E] != R:
        raise ValueError("experts: weight, activation and output shapes do not match")
    for e in range(E):
        if starts[e + 1] < starts[e]:
            raise ValueError("experts: rows out of order")
    for i in range(R):
        if rows[i] < 0 or rows[i] >= ys.shape[0]:
            raise ValueError("experts: a row outside the step")


@nb.njit(inline="always", **JIT)  # inlined: as a call, decode's int4 job ran ~10 % slower (measured)
def activate(act, h, u, params, gb, ub, I, i_lo, i_hi, n_lo, n_hi):
    # an expert unit's activation on rows i_lo .. i_hi, columns n_lo .. n_hi of h (gate x), u
    # (up x), into h: silu(h) * u (ACT_SILU), or gpt-oss's (ACT_CLAMPED: biases at gb, ub)
    if act == ACT_SILU:
        silu_mul_rows(h, u, h, i_lo, i_hi, n_lo, n_hi)
    else:
        clamped_rows(h, u, nb.carray(f32_at(gb), (I,)), nb.carray(f32_at(ub), (I,)), params[0], params[1],
                     i_lo, i_hi, n_lo, n_hi)


@nb.njit(inline="always", **JIT)
def weigh(out, db, rows, wts, ys, i_lo, i_hi, d_lo, d_hi):
    # an expert unit's down rows d_lo .. d_hi into ys: ys[rows[i]] = wts[rows[i]] * (out[i] + the
    # down bias at db, if any) for i_lo <= i < i_hi
    D = out.shape[1]
    if db != 0:
        b = nb.carray(f32_at(db), (D,))
        for i in range(i_lo, i_hi):
            for d in range(d_lo, d_hi):
                out[i, d] += b[d]
    for i in range(i_lo, i_hi):
        w = wts[rows[i]]
        for d in range(d_lo, d_hi):
            ys[rows[i], d] = out[i, d] * w
