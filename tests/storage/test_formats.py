"""The number formats' registry: each format declared once (storage/formats/), with kernels
registered once (engine/formats/), its one code unique, and what it declares true of the
bytes: a record's codes and scales read back as the weight they were written from."""

import numpy as np
import pytest

from colibri.engine import crew
from colibri.engine.formats import KERNELS
from colibri.storage.formats import FORMATS, PLAIN_CODES, PUBLISHED_DTYPES, QUANT_DTYPES
from colibri.storage.quant import (
    QuantWeight,
    check_group,
    dequantize,
    from_record,
    quantize,
    quantized_shapes,
)


def test_every_format_has_one_code_and_its_kernels():
    codes = [f.code for f in FORMATS.values()] + list(PLAIN_CODES.values())
    assert len(set(codes)) == len(codes)
    assert set(KERNELS) == set(FORMATS)
    assert all(name in KERNELS[name].KINDS for name in FORMATS)
    assert set(QUANT_DTYPES) | set(PUBLISHED_DTYPES) == set(FORMATS) and not set(QUANT_DTYPES) & set(PUBLISHED_DTYPES)
    # the crew's job board knows a weight by the same code (no table of its own)
    w = QuantWeight("fp8_e5m2", np.zeros((4, 8), np.uint8), np.ones((1, 1), np.float32), 8, 4)
    assert crew.tok_kind(w, w, w) == FORMATS["fp8_e5m2"].code != FORMATS["fp8_e4m3"].code
    assert crew.tok_kind(*[np.zeros((4, 8), np.uint16)] * 3) == PLAIN_CODES["bf16"]


@pytest.mark.parametrize("kind", QUANT_DTYPES)
def test_own_formats_round_trip_through_a_record(kind):
    rng = np.random.default_rng(1)
    w = rng.standard_normal((6, 128)).astype(np.float32)
    g = FORMATS[kind].groups[0] if FORMATS[kind].groups else 32
    qw = quantize(w, kind, g)
    assert (qw.q.shape, qw.scales.shape) == quantized_shapes(kind, w.shape, g) and qw.shape == w.shape
    again = from_record(kind, qw.q, qw.scales)
    assert again.group_size == g and np.array_equal(dequantize(again), dequantize(qw))
    qmax = 127 if kind == "int8" else 7
    err = np.abs(dequantize(qw) - w).reshape(6, -1, g).max(axis=-1)
    assert np.all(err <= np.abs(w).reshape(6, -1, g).max(axis=-1) / qmax / 2 * 1.01)  # half a step, at most


def test_group_sizes_are_checked_by_the_formats_own_list():
    assert check_group("int4", (4, 96), 96) == "int4 group size must be one of 32, 64, 128, not 96"
    assert check_group("int8", (4, 96), 96) is None
    assert "does not divide" in check_group("int8", (4, 96), 64)


def test_published_formats_read_back_with_their_block():
    q = np.arange(4 * 6, dtype=np.uint8).reshape(4, 6)
    w = from_record("fp8_e4m3", q, np.array([[2.0, 4.0]], np.float32), (4, 3))
    assert (w.row_block, w.group_size, w.shape) == (4, 3, (4, 6))
    ref = FORMATS["fp8_e4m3"].values[q] * np.repeat([[2.0, 4.0]], 3, axis=1)
    assert np.array_equal(dequantize(w), ref)
    one = from_record("fp8_e4m3", q, np.array([[0.5]], np.float32))  # no block: one scale per matrix
    assert (one.row_block, one.group_size) == (4, 6)
    mx = from_record("mxfp4", np.full((2, 16), 0x21, np.uint8), np.full((2, 1), 128, np.uint8), (1, 32))
    assert mx.shape == (2, 32) and np.array_equal(dequantize(mx)[0, :2], [1.0, 2.0])  # codes 1 (0.5), 2 (1) times 2 ** 1
