"""The FP8 and MXFP4 kernels against numpy's dequantization: the codes' values as torch
decodes them, every shape around the kernels' blocks (token blocks of 2, 32-column chunk
groups, ROW_BLOCK rows on the prompt path, partial scale blocks), each token's result the
same alone as in a batch."""

import numpy as np
import pytest
import torch

from colibri.engine.formats import fp8, mxfp4
from colibri.engine.kernels import ROW_BLOCK
from colibri.storage.formats import FORMATS
from colibri.storage.formats.mxfp4 import E2M1_VALUES, E8M0_VALUES
from colibri.storage.fpformats import check_finite
from colibri.storage.quant import QuantWeight, dequantize

RTOL = 2e-6  # of the largest output: float32 sums in another order than float64's


@pytest.mark.parametrize("kind,dtype", [("fp8_e4m3", torch.float8_e4m3fn), ("fp8_e5m2", torch.float8_e5m2)])
def test_fp8_values_are_torchs(kind, dtype):
    ref = torch.arange(256, dtype=torch.uint8).view(dtype).float().numpy()
    assert np.array_equal(FORMATS[kind].values, ref, equal_nan=True)


def test_e8m0_and_e2m1_values():
    assert np.array_equal(E8M0_VALUES[:255], np.ldexp(1.0, np.arange(255) - 127).astype(np.float32))
    from hf_models import E2M1

    assert np.array_equal(E2M1_VALUES, E2M1.numpy())


def finite_codes(rng, kind, shape):
    q = rng.integers(0, 256, shape).astype(np.uint8)
    bad = ~np.isfinite(FORMATS[kind].values[q])
    q[bad] &= 0x70  # a finite code instead
    check_finite(q, kind, "test")
    return q


def check_against_reference(run, W, K, rng, tokens=(1, 2, 3, 4, 5)):
    for T in tokens:
        x = rng.standard_normal((T, K)).astype(np.float32)
        ref = x.astype(np.float64) @ W.T.astype(np.float64)
        for prompt in (False, True):
            out = run(x, prompt)
            assert np.abs(out - ref).max() <= RTOL * max(1.0, np.abs(ref).max()), (T, prompt)
            for t in range(T):  # alone = batched, on either path
                assert np.array_equal(run(x[t : t + 1], prompt)[0], out[t]), (T, t, prompt)


@pytest.mark.parametrize("kind", ["fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("N,K,bn,bk", [
    (1, 8, 1, 8), (ROW_BLOCK - 1, 31, 4, 16), (ROW_BLOCK, 32, 16, 32), (ROW_BLOCK + 1, 33, 5, 7),
    (2 * ROW_BLOCK + 3, 96, 128, 128), (40, 100, 16, 24), (7, 300, 3, 64), (9, 257, 9, 257),
])
def test_fp8_matches_dequantized(kind, N, K, bn, bk):
    rng = np.random.default_rng(N * 1000 + K)
    q = finite_codes(rng, kind, (N, K))
    s = (rng.random((-(-N // bn), -(-K // bk))) * 0.01 + 1e-3).astype(np.float32)
    w = QuantWeight(kind, q, s, bk, bn)
    W = dequantize(w)
    assert W.shape == (N, K)
    fmt = FORMATS[kind].code

    def run(x, prompt):
        out = np.empty((x.shape[0], N), np.float32)
        if prompt:
            fp8.LINEAR_F8_TOK[fmt](x, q, s, bn, bk, FORMATS[kind].values, out)
        else:
            fp8.LINEAR_F8[fmt](x, q, s, bn, bk, out)
        return out

    check_against_reference(run, W, K, rng)


@pytest.mark.parametrize("N,K", [  # 1 .. 9 blocks a row: groups of two or four blocks, a pair and an odd block left
    (1, 32), (ROW_BLOCK - 1, 64), (ROW_BLOCK, 96), (2, 128), (ROW_BLOCK + 1, 2880 // 10), (33, 32), (5, 192), (3, 224),
])
def test_mxfp4_matches_dequantized(N, K):
    rng = np.random.default_rng(N * 1000 + K)
    q = rng.integers(0, 256, (N, K // 2)).astype(np.uint8)
    s = rng.integers(100, 140, (N, K // 32)).astype(np.uint8)
    W = dequantize(QuantWeight("mxfp4", q, s, 32))

    def run(x, prompt):
        out = np.empty((x.shape[0], N), np.float32)
        if prompt:
            mxfp4.linear_mx4_tok(x, q, s, E8M0_VALUES, E2M1_VALUES, out)
        else:
            mxfp4.linear_mx4(x, q, s, E8M0_VALUES, out)
        return out

    check_against_reference(run, W, K, rng)


def test_shapes_that_do_not_match_are_refused():
    q, s = np.zeros((4, 64), np.uint8), np.ones((1, 1), np.float32)
    out = np.empty((1, 4), np.float32)
    with pytest.raises(ValueError, match="fp8 kernel"):
        fp8.LINEAR_F8[FORMATS["fp8_e4m3"].code](np.zeros((1, 64), np.float32), q, s, 2, 64, out)  # 2 row blocks, 1 scale row
    with pytest.raises(ValueError, match="mxfp4 kernel"):
        mxfp4.linear_mx4(np.zeros((1, 60), np.float32), np.zeros((4, 30), np.uint8), np.zeros((4, 2), np.uint8),
                             E8M0_VALUES, out)


@pytest.mark.parametrize("kind", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_decode_path_holds_for_activations_of_any_size(kind):
    # the decode kernel scales each token's x by a power of two of its own (f8_prescale): a
    # token of huge, tiny or zero activations beside ordinary ones keeps full precision and
    # the same bits alone as batched
    rng = np.random.default_rng(7)
    N, K = 40, 300
    q = finite_codes(rng, kind, (N, K))
    s = (rng.random((1, -(-K // 128))) * 0.01 + 1e-3).astype(np.float32)
    W = dequantize(QuantWeight(kind, q, s, 128, N)).astype(np.float64)
    fmt = FORMATS[kind].code
    x = rng.standard_normal((5, K)).astype(np.float32) * np.array([[1.0], [2.0**70], [2.0**-90], [0.0], [1e-3]], np.float32)
    x[4, 7] = 2.0**40  # one large activation among small ones
    out = np.empty((5, N), np.float32)
    fp8.LINEAR_F8[fmt](x, q, s, N, 128, out)
    ref = x.astype(np.float64) @ W.T
    for t in range(5):
        assert np.abs(out[t] - ref[t]).max() <= RTOL * np.abs(ref[t]).max(), t
        alone = np.empty((1, N), np.float32)
        fp8.LINEAR_F8[fmt](x[t : t + 1], q, s, N, 128, alone)
        assert np.array_equal(alone[0], out[t]), t
    assert not out[3].any()
