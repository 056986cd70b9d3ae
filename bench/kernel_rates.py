"""Kernel benchmark: GB/s of weight bytes the bf16 (and f16) expert matvec and the int4,
FP8 (e4m3, 128 x 128 scale blocks) and MXFP4 experts (gate, up, silu, down, as decode runs
them) reach at batch 1, next to the memory read bandwidth measured in the same run, and
their ratio.

    python bench/kernel_rates.py [--mib 512] [--repeat 3] [--threads 1,N]

Prints one JSON object with a section per thread count (default 1 and the CPUs this process
may use): on N threads, N sweeps of their own share of the matrices or experts run at once
(the kernels release the GIL; decode takes a step's experts side by side the same way) and
the memory bandwidth is that of N threads reading at once. The weights cycle through a
working set far larger than the CPU caches, so every byte comes from DRAM.
"""

import argparse
import os
import platform
import time
from concurrent.futures import ThreadPoolExecutor

for var, val in {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"}.items():
    os.environ.setdefault(var, val)

import numpy as np  # noqa: E402
import provenance  # noqa: E402

from colibri.engine import kernels, layers  # noqa: E402

SHAPES = {  # (rows, cols) of one expert matrix (gate/up: [I, D])
    "qwen3_moe_30b_a3b": (768, 2048),
    "mixtral_8x7b_slice": (1792, 4096),
    "olmoe_1b_7b": (1024, 2048),
    "deepseek_v3": (2048, 7168),
    "gpt_oss_120b": (2880, 2880),
}


def best(fn, repeat):
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def on_threads(items, work, threads: int):
    """A sweep that runs work(item) over `items`, split into `threads` shares run at once."""
    shares = [items[i::threads] for i in range(threads)]

    def sweep():
        if threads == 1:
            for it in items:
                work(it)
            return
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(lambda share: [work(it) for it in share], shares))

    return sweep


def memory_read_gbs(mib: int, repeat: int, threads: int) -> float:
    bufs = [np.ones(mib * 2**20 // 8 // threads, np.uint64) for _ in range(threads)]
    for b in bufs:
        kernels.read_bandwidth(b, 1)  # compile, fault in
    sweep = on_threads(bufs, lambda b: kernels.read_bandwidth(b, 1), threads)
    return sum(b.nbytes for b in bufs) / best(sweep, repeat) / 1e9


def matvec_gbs(rows: int, cols: int, dtype: str, mib: int, repeat: int, threads: int) -> float:
    rng = np.random.default_rng(0)
    one = rows * cols * 2
    n = max(2 * threads, mib * 2**20 // one)
    bits = rng.integers(0x3C00, 0x3E00, size=(n, rows, cols), dtype=np.uint16)  # finite values in both formats
    ws = bits if dtype == "bf16" else bits.view(np.float16)
    x = rng.standard_normal((1, cols), dtype=np.float32)
    f16 = kernels.f16_table()

    def matvec(w):
        kernels.matmul_u16(x, w.view(np.uint16), dtype == "bf16", f16, np.empty((1, rows), np.float32))

    sweep = on_threads(list(ws), matvec, threads)
    sweep()
    return ws.nbytes / best(sweep, repeat) / 1e9


def fp8_codes(v: np.ndarray) -> np.ndarray:
    """The e4m3 codes nearest to v (clipped to +-448). Their mix matters: a code with a zero
    exponent field (|v| < 2 ** -6, one weight in ~10^4 of real checkpoints) decodes through a
    subnormal float32, which the CPU multiplies slowly, so uniformly random codes (1 in 16
    such) understate the kernel."""
    from colibri.storage.formats import FORMATS

    table = FORMATS["fp8_e4m3"].values[:0x7F]  # the non-negative codes 0 .. 126, increasing
    a = np.minimum(np.abs(v), table[-1])
    i = np.clip(np.searchsorted(table, a), 1, len(table) - 1)
    i -= (a - table[i - 1]) < (table[i] - a)
    return (i.astype(np.uint8) | np.where(v < 0, 0x80, 0).astype(np.uint8)).astype(np.uint8)


def make_weight(kind: str, rng, n: int, d: int):
    """A random [n, d] QuantWeight of `kind` with finite values: int4 g64, fp8_e4m3 in 128 x
    128 blocks, mxfp4."""
    from colibri.storage.quant import QuantWeight

    if kind == "int4":
        return QuantWeight("int4", rng.integers(0, 256, (n, d // 2), dtype=np.uint8),
                           rng.uniform(0.01, 0.02, (n, d // 64)).astype(np.float16), 64)
    if kind == "fp8_e4m3":  # the codes of normal weights quantized as the releases are (a block's max to 448)
        return QuantWeight(kind, fp8_codes(rng.standard_normal((n, d), dtype=np.float32) * np.float32(448 / 4.5)),
                           rng.uniform(1e-4, 2e-4, (-(-n // 128), -(-d // 128))).astype(np.float32), 128, 128)
    return QuantWeight("mxfp4", rng.integers(0, 256, (n, d // 2), dtype=np.uint8),
                       rng.integers(118, 122, (n, d // 32), dtype=np.uint8), 32)


def expert_gbs(rows: int, cols: int, kind: str, mib: int, repeat: int, threads: int) -> float:
    """One expert of `kind` (gate and up [rows, cols], down [cols, rows]) per call, as decode
    runs it: GB/s of its bytes (values and scales)."""
    rng = np.random.default_rng(0)
    first = [make_weight(kind, rng, rows, cols), make_weight(kind, rng, rows, cols), make_weight(kind, rng, cols, rows)]
    one = sum(w.nbytes for w in first)
    experts = [first] + [[make_weight(kind, rng, rows, cols), make_weight(kind, rng, rows, cols),
                          make_weight(kind, rng, cols, rows)] for _ in range(max(2 * threads, mib * 2**20 // one) - 1)]
    x = rng.standard_normal((1, cols), dtype=np.float32)
    sweep = on_threads(experts, lambda e: layers.swiglu(x, *e), threads)
    sweep()
    return len(experts) * one / best(sweep, repeat) / 1e9


EXPERT_KINDS = {"int4": "int4 g64 expert (gate+up+down)", "fp8_e4m3": "fp8_e4m3 128x128 expert (gate+up+down)",
                "mxfp4": "mxfp4 expert (gate+up+down)"}


def measure(a, threads: int) -> dict:
    mem = memory_read_gbs(a.mib, a.repeat, threads)
    results = []
    for name, (rows, cols) in SHAPES.items():
        for dtype in ("bf16", "f16"):
            gbs = matvec_gbs(rows, cols, dtype, a.mib, a.repeat, threads)
            results.append({"shape": name, "rows": rows, "cols": cols, "dtype": dtype, "batch": 1,
                            "weight_gbs": round(gbs, 2), "ratio_to_memory": round(gbs / mem, 3)})
    for kind, label in EXPERT_KINDS.items():
        for name, (rows, cols) in SHAPES.items():
            gbs = expert_gbs(rows, cols, kind, a.mib, a.repeat, threads)
            results.append({"shape": name, "rows": rows, "cols": cols, "dtype": label, "batch": 1,
                            "weight_gbs": round(gbs, 2), "ratio_to_memory": round(gbs / mem, 3)})
    bf16 = [r["weight_gbs"] for r in results if r["dtype"] == "bf16"]
    by_kind = {label: round(float(np.median([r["ratio_to_memory"] for r in results if r["dtype"] == label])), 3)
               for label in ["bf16", "f16", *EXPERT_KINDS.values()]}
    return {"threads": threads, "memory_read_gbs": round(mem, 2), "bf16_matvec_gbs": round(float(np.median(bf16)), 2),
            "median_ratio_to_memory": by_kind, "results": results}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=512, help="working set per measurement (MiB)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", default=f"1,{len(os.sched_getaffinity(0))}",
                    help="comma-separated thread counts (default: 1 and this process's CPUs)")
    a = ap.parse_args()
    layers.init()
    counts = sorted({int(t) for t in a.threads.split(",")})
    print(provenance.dumps({
        "benchmark": "kernels",
        "machine": {"cpu": platform.processor() or platform.machine(), "cpus": len(os.sched_getaffinity(0))},
        "target_ratio": 0.5,
        "runs": [measure(a, t) for t in counts],
    }, indent=2))


if __name__ == "__main__":
    main()
