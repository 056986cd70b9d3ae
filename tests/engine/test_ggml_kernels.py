"""The kernels of GGUF's block formats (engine/formats/ggml.py) against the `gguf` package's
own numpy dequantisation: every format's decoder bit for bit on random blocks (every code,
scales of every size), matrices of one, two and three blocks a row and of rows around
ROW_BLOCK, and the parallel kernel; the decode path's IR row dots (Q4_K, Q6_K, Q8_0: ggml_ir.py)
in vectors of 16 lanes and of 8; each token's result the same alone as in a batch, and each
row of a step by its own sequence's path."""

import numpy as np
import pytest
from gguf_models import blocks

from colibri.engine.formats import ggml as kernels
from colibri.engine.kernels import PARALLEL_MIN_ELEMENTS, ROW_BLOCK, f16_lut
from colibri.storage.formats import FORMATS, ggml
from colibri.storage.quant import QuantWeight, dequantize

RTOL = 2e-6  # of the largest output: float32 sums in another order than float64's
KINDS = list(ggml.TYPES)
GGUF_NAME = {kind: name for name, kind in ggml.BY_TYPE_NAME.items()}


def weight(kind, q):
    return QuantWeight(kind, q, np.zeros((q.shape[0], 0), np.uint8), ggml.TYPES[kind][1])


@np.errstate(all="ignore")  # (the package's own warnings on the blocks drawn again)
def random_blocks(kind, n, blocks_a_row, rng):
    # every byte random (codes, packed sub-block scales), the float16 / e8m0 scales as random as
    # keeps the values finite
    _, _, nbytes = ggml.TYPES[kind]
    q = rng.integers(0, 256, (n, blocks_a_row * nbytes), dtype=np.uint8)
    w = weight(kind, q)
    bad = ~np.isfinite(dequantize(w)).reshape(n, blocks_a_row, -1).all(-1)
    while bad.any():  # a block with an infinite or NaN scale: drawn again
        q.reshape(n, blocks_a_row, nbytes)[bad] = rng.integers(0, 256, (int(bad.sum()), nbytes), dtype=np.uint8)
        bad = ~np.isfinite(dequantize(w)).reshape(n, blocks_a_row, -1).all(-1)
    return q


def test_every_gguf_block_type_is_a_format_with_the_packages_sizes():
    import gguf

    for kind, (type_id, qk, nbytes) in ggml.TYPES.items():
        t = gguf.GGMLQuantizationType(type_id)
        assert gguf.GGML_QUANT_SIZES[t] == (qk, nbytes) and ggml.BY_TYPE_NAME[t.name] == kind
        fmt = FORMATS[kind]
        assert fmt.published and fmt.block == (qk, nbytes) and fmt.columns(3 * nbytes) == 3 * qk
    assert np.array_equal(ggml.e8m0_half(), gguf.quants.MXFP4.e8m0_to_fp32_half(np.arange(256, dtype=np.uint8)))


@pytest.mark.parametrize("kind", KINDS)
def test_the_decoders_are_the_packages_dequantisation_bit_for_bit(kind):
    rng = np.random.default_rng(ggml.TYPES[kind][0])
    for n_blocks in (1, 2, 3):
        q = random_blocks(kind, 7, n_blocks, rng)
        want = dequantize(weight(kind, q))
        K = want.shape[1]
        for n0, nr in ((0, 7), (2, 3)):
            wb = np.full((nr, K), np.nan, np.float32)
            kernels.ggml_rows(FORMATS[kind].code, q, f16_lut(), n0, nr, wb)
            assert np.array_equal(wb.view(np.uint32), want[n0 : n0 + nr].view(np.uint32)), (n_blocks, n0)


def dot(kind, lanes):
    # the decode path's IR row dot of `kind` in vectors of `lanes`, as linear's signature
    def run(x, w, out, prompt=False):
        kernels.ggml_dot(FORMATS[kind].code, lanes, x, w.q, f16_lut(), out, 0, w.q.shape[0])
    return run


def check_linear(kind, q, rng, tokens=(1, 2, 3, 5)):
    w = weight(kind, q)
    W = dequantize(w).astype(np.float64)
    N, K = W.shape
    paths = {"decode": (kernels.linear, False), "prompt": (kernels.linear, True)}
    if kind in kernels.DOT_KINDS:  # both widths of the IR row dot, whichever this CPU runs
        paths |= {f"dot{lanes}": (dot(kind, lanes), False) for lanes in (16, 8)}
    for T in tokens:
        x = rng.standard_normal((T, K)).astype(np.float32)
        ref = x.astype(np.float64) @ W.T
        outs = {}
        for name, (fn, prompt) in paths.items():
            out = np.empty((T, N), np.float32)
            fn(x, w, out, prompt)
            assert np.abs(out - ref).max() <= RTOL * max(1.0, np.abs(ref).max()), (T, name)
            for t in range(T):  # alone = batched
                one = np.empty((1, N), np.float32)
                fn(np.ascontiguousarray(x[t : t + 1]), w, one, prompt)
                assert np.array_equal(one[0], out[t]), (T, t, name)
            outs[name] = out
        if kind not in kernels.DOT_KINDS:  # one path for decode and prompt rows
            assert np.array_equal(outs["decode"], outs["prompt"])
        else:  # the decode path is the row dot this CPU runs best
            assert np.array_equal(outs["decode"], outs[f"dot{kernels.LANES}"])
        if T > 1:  # a step's rows, each by its sequence's path (a dense matrix's: layers.linear)
            mask = np.arange(T) % 2 == 0
            out = np.empty((T, N), np.float32)
            kernels.linear(x, w, out, mask)
            assert np.array_equal(out[mask], outs["prompt"][mask]) and np.array_equal(out[~mask], outs["decode"][~mask])


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("N,n_blocks", [(1, 1), (ROW_BLOCK - 1, 2), (ROW_BLOCK + 1, 3), (3 * ROW_BLOCK + 5, 1)])
def test_linear_matches_the_dequantised_matrix(kind, N, n_blocks):
    rng = np.random.default_rng(N * 100 + n_blocks)
    q = blocks(rng.standard_normal((N, n_blocks * ggml.TYPES[kind][1])).astype(np.float32) * 0.02,
               GGUF_NAME[kind], seed=N)
    check_linear(kind, q, rng)


def test_a_large_matrix_takes_the_parallel_kernel_with_the_same_rows():
    rng = np.random.default_rng(4)
    N, K = PARALLEL_MIN_ELEMENTS // 1024 + 3, 1024
    q = blocks(rng.standard_normal((N, K)).astype(np.float32), "Q6_K")
    w = weight("q6_k", q)
    x = rng.standard_normal((2, K)).astype(np.float32)
    ref = x.astype(np.float64) @ dequantize(w).astype(np.float64).T
    for prompt in (False, True):  # the row dots', the tiles'
        out = np.empty((2, N), np.float32)
        kernels.linear(x, w, out, prompt)
        some = weight("q6_k", np.ascontiguousarray(q[: ROW_BLOCK + 2]))
        part = np.empty((2, ROW_BLOCK + 2), np.float32)
        kernels.linear(x, some, part, prompt)
        assert np.array_equal(out[:, : ROW_BLOCK + 2], part)
        assert np.abs(out - ref).max() <= RTOL * np.abs(ref).max()


def test_shapes_that_do_not_match_are_refused():
    q = np.zeros((4, 2 * 144), np.uint8)
    w = weight("q4_k", q)
    for x, out in ((np.ones((1, 256), np.float32), np.empty((1, 4), np.float32)),  # one block short
                   (np.ones((1, 512), np.float32), np.empty((1, 3), np.float32)),
                   (np.ones((1, 500), np.float32), np.empty((1, 4), np.float32))):
        with pytest.raises(ValueError, match="do not match"):
            kernels.linear(x, w, out)
