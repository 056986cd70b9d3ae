"""Prefill benchmark: prompts of 16, 64, 512 and 2048 tokens on the decode benchmark's
model (bench/synthetic.py: Qwen3-30B-A3B's shape, or --family's, as many layers as
--layers), its experts in bf16 and in int4, warm (every expert in RAM) and at a 10 % expert
budget cold, next to the machine's limits measured in the same run.

    python bench/prefill.py [--workdir DIR] [--family qwen3_moe] [--layers 12] [--experts 64]
                            [--precisions int4,bf16] [--prompts 16,64,512,2048] [--repeat 3]
                            [--budget 0.1] [--threads 1,N]

Per prompt and precision it prints: wall time, prompt tokens/s, the weight bytes the step
touches (the dense part plus the union of the experts its tokens chose, each once), the
multiply-adds it does; and the ratios the targets are stated in:
- `memory_ratio` = (bytes touched / memory read bandwidth) / wall (<= 64 tokens: the step
  should read each byte once, target >= 1 / 1.5);
- `fma_ratio` = achieved multiply-add rate / the machine's float32 FMA peak (>= 512
  tokens: compute-bound, target >= 0.5);
- cold at the budget: wall / max(disk floor, warm wall) (target <= 1.3), the disk floor
  being the bytes read / the O_DIRECT bandwidth, measured right before and right after
  the cold step (their mean: this shared disk's rate drifts by half within a minute), and
  `disk_busy_fraction`, the part of the step with a read in flight (1: the disk never
  waited for compute).
Warm runs go at each thread count of --threads (default 1 and every CPU: the scaling), the
cold ones at the largest. A warm prompt is computed once to warm up and then --repeat times
(default 3), the best of those reported (`wall_s`, all of them in `walls_s`): a long-lived
process's steady state. The first steps of a process are slower while malloc's heap grows
to the steps' temporaries (a 512-token step faulted 50,000 pages in first, 29,000 the next,
then ~7,000: 4.0, 3.3, then 3.2 s). The peaks are measured at each thread count: memory by
a parallel sum over 256 MiB, FMA by independent multiply-add chains in the CPU's widest
float32 vectors (16 lanes with AVX-512, else 8, as the kernels use) on every thread (a
numba kernel in LLVM IR, so that what it measures is the CPU, not a compiler's choice),
disk by decode.py's random O_DIRECT record reads.
"""

import argparse
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

for var, val in {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"}.items():
    os.environ.setdefault(var, val)

import numba as nb  # noqa: E402
import numpy as np  # noqa: E402
from llvmlite import ir  # noqa: E402
from numba import types  # noqa: E402
from numba.core import cgutils  # noqa: E402
from numba.extending import intrinsic  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import provenance  # noqa: E402
from decode import disk_gbs, drop_caches  # noqa: E402
from synthetic import SHAPES, build, load_model, prompt  # noqa: E402

from colibri.engine import kernels, layers  # noqa: E402
from colibri.engine.ir import host_features  # noqa: E402

CHAINS = 12  # independent vector FMA chains: enough to cover the FMA latency of every x86 and ARM core
LANES = 16 if "+avx512f" in host_features() else 8  # the kernels' widest vectors (engine/ir.py)


@intrinsic
def _fma_chains(typingctx, n):
    # n rounds of CHAINS independent LANES-lane multiply-adds, kept in registers; returns their sum
    # (so nothing is optimised away)
    if not isinstance(n, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        f32 = ir.FloatType()
        vf = ir.VectorType(f32, LANES)
        fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vf, [vf] * 3), f"llvm.fma.v{LANES}f32")
        accs = [cgutils.alloca_once_value(builder, ir.Constant(vf, [0.001 * (k + 1)] * LANES)) for k in range(CHAINS)]
        a, b = ir.Constant(vf, [0.999999] * LANES), ir.Constant(vf, [1e-7] * LANES)
        with cgutils.for_range(builder, context.cast(builder, args[0], sig.args[0], types.int64)):
            for acc in accs:
                builder.store(builder.call(fma, [builder.load(acc), a, b]), acc)
        total = builder.load(accs[0])
        for acc in accs[1:]:
            total = builder.fadd(total, builder.load(acc))
        return builder.extract_element(total, ir.Constant(ir.IntType(32), 0))

    return types.float32(n), codegen


@nb.njit(nogil=True)
def fma_rounds(n):
    return _fma_chains(n)


def fma_peak_gflops(threads: int, seconds: float = 1.0) -> float:
    """float32 multiply-adds per second (x 2: flops), CHAINS x LANES lanes per round, on `threads`
    threads at once (the kernel releases the GIL)."""
    fma_rounds(10)
    n = 1 << 22
    t0 = time.perf_counter()
    fma_rounds(n)
    per_s = n / (time.perf_counter() - t0)
    n = max(1 << 20, int(per_s * seconds))
    with ThreadPoolExecutor(threads) as pool:
        t0 = time.perf_counter()
        list(pool.map(fma_rounds, [n] * threads))
        dt = time.perf_counter() - t0
    return 2 * CHAINS * LANES * n * threads / dt / 1e9


def memory_gbs(threads: int) -> float:
    """The memory read bandwidth of `threads` threads summing their part of 256 MiB at once."""
    bufs = [np.ones(256 * 2**20 // 8 // threads, np.uint64) for _ in range(threads)]
    for b in bufs:
        kernels.read_bandwidth(b, 1)
    with ThreadPoolExecutor(threads) as pool:
        t0 = time.perf_counter()
        list(pool.map(lambda b: kernels.read_bandwidth(b, 2), bufs))
        dt = time.perf_counter() - t0
    return 2 * sum(b.nbytes for b in bufs) / dt / 1e9


def prefill(model, ids) -> tuple[float, dict]:
    """Wall time of one prompt step (a fresh KV cache) and what the experts did in it."""
    st0 = model.experts.stats.copy()
    t0 = time.perf_counter()
    model.forward(np.asarray(ids), model.new_cache(len(ids) + 1))
    wall = time.perf_counter() - t0
    return wall, model.experts.stats.minus(st0)


def step_work(model, st, n_tokens: int) -> tuple[int, int]:
    """(weight bytes the step touched, multiply-adds it did): the dense part once plus each
    expert of the union once; per token the dense matrices (embeddings excluded: a lookup)
    and the experts it chose, the LM head once (a prompt step computes the last position's
    logits only), and attention on the full-attention layers: each token's query against
    the keys up to it and the weights against the values (T (T + 1) / 2 pairs, heads x
    head_dim each way); a hybrid's linear layers (Gated DeltaNet) do four multiply-adds a
    token per element of each value head's [key dim, value dim] state (decay, read,
    update, query)."""
    c = model.experts.c
    embed = model.glob["embed"].size
    dense_bytes = model.describe()["dense_bytes"] - model.glob["embed"].nbytes
    dense_params = sum(a.size for L in model.layers for a in L.values()) + sum(
        a.size for k, a in model.glob.items() if k != "embed")
    if model.args.tie_word_embeddings:
        dense_params += embed
    expert_params = 3 * model.args.hidden_size * model.args.moe_intermediate_size
    head = model.lm_head.size
    macs = n_tokens * (dense_params - head + model.n_expert_used * len(model.moe_layers) * expert_params) + head
    a = model.args
    n_full, n_lin = getattr(model, "n_full", model.n_layer), getattr(model, "n_lin", 0)
    macs += n_full * n_tokens * (n_tokens + 1) // 2 * a.num_attention_heads * a.head_dim * 2
    if n_lin:
        macs += n_lin * n_tokens * a.linear_num_value_heads * a.linear_key_head_dim * a.linear_value_head_dim * 4
    return dense_bytes + st.experts * c.record_bytes, macs


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", default=os.path.join(os.path.expanduser("~"), ".cache", "colibri", "bench"))
    ap.add_argument("--family", default="qwen3_moe", choices=sorted(SHAPES), help="the model's shape (synthetic.SHAPES)")
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--experts", type=int, default=None,
                    help="experts per layer (default: 64 for qwen3_moe, whose Qwen3-30B-A3B has 128; else the shape's)")
    ap.add_argument("--precisions", default="int4,bf16")
    ap.add_argument("--prompts", default="16,64,512,2048")
    ap.add_argument("--repeat", type=int, default=3, help="warm runs of each prompt after the first (the best reported)")
    ap.add_argument("--budget", type=float, default=0.1, help="the cold run's expert budget, a fraction (0: none)")
    ap.add_argument("--threads", default=f"1,{len(os.sched_getaffinity(0))}",
                    help="thread counts of the warm runs (the cold ones at the largest)")
    a = ap.parse_args()
    os.makedirs(a.workdir, exist_ok=True)
    counts = sorted({int(n) for n in a.threads.split(",")})
    layers.init(counts[-1])
    lengths = [int(n) for n in a.prompts.split(",")]
    rng = np.random.default_rng(11)
    prompts = {n: prompt(rng, n) for n in lengths}
    limits = {}
    for n_threads in counts:
        limits[n_threads] = {"threads": n_threads, "memory_gbs": round(memory_gbs(n_threads), 2),
                             "fma_peak_gflops": round(fma_peak_gflops(n_threads), 1)}
    shape = SHAPES[a.family]
    n_expert = a.experts or (64 if a.family == "qwen3_moe" else shape.get("num_experts") or
                             shape.get("num_local_experts") or shape["n_routed_experts"])
    out = []
    for precision in a.precisions.split(","):
        path = build(a.workdir, 0, n_layer=a.layers, family=a.family, precision=precision,
                     overrides={"num_experts": n_expert} if a.experts or a.family == "qwen3_moe" else None)
        warm = load_model(path, budget="all")
        prefill(warm, prompts[lengths[0]][:4])  # compile every kernel the steps take
        for n_threads in counts:
            layers.init(n_threads)  # the compute threads (crew, side-by-side experts, numba's)
            lim = limits[n_threads]
            for n in lengths:
                prefill(warm, prompts[n])  # every expert this prompt chooses in RAM, its kernels warm
                runs = [prefill(warm, prompts[n]) for _ in range(max(1, a.repeat))]
                wall, st = min(runs, key=lambda r: r[0])
                touched, macs = step_work(warm, st, n)
                row = {"precision": precision, "threads": n_threads, "prompt_tokens": n, "wall_s": round(wall, 3),
                       "walls_s": [round(r[0], 3) for r in runs],
                       "prompt_tok_s": round(n / wall, 1), "bytes_touched": touched, "macs": macs,
                       "memory_ratio": round(touched / (lim["memory_gbs"] * 1e9) / wall, 3),
                       "fma_ratio": round(2 * macs / (lim["fma_peak_gflops"] * 1e9) / wall, 3)}
                out.append(row)
                print(json.dumps(row), file=sys.stderr)
        if a.budget:
            c = warm.experts.c
            budget = int(c.expert_bytes * a.budget)
            del warm
            for n in lengths:
                warm_wall = next(r["wall_s"] for r in out if r["precision"] == precision and r["prompt_tokens"] == n
                                 and r["threads"] == counts[-1])
                before = max(disk_gbs(c, 2, 2.0), disk_gbs(c, 4, 2.0))
                dropped = drop_caches()
                model = load_model(path, budget=budget)
                wall, st = prefill(model, prompts[n])
                after = max(disk_gbs(c, 2, 2.0), disk_gbs(c, 4, 2.0))
                cold_disk = (before + after) / 2
                floor = st.bytes_read / (cold_disk * 1e9)
                row = {"precision": precision, "threads": counts[-1], "prompt_tokens": n, "budget_fraction": a.budget,
                       "cold": dropped,
                       "wall_s": round(wall, 3), "bytes_read": st.bytes_read, "disk_odirect_gbs": round(cold_disk, 3),
                       "disk_before_after_gbs": [round(before, 3), round(after, 3)],
                       "disk_floor_s": round(floor, 3), "warm_wall_s": warm_wall,
                       "disk_busy_fraction": round(st.io_wall_s / wall, 3),
                       "ratio_to_floor": round(wall / max(floor, warm_wall), 3)}
                out.append(row)
                print(json.dumps(row), file=sys.stderr)
                model.experts.close()
                del model
    print(provenance.dumps({"benchmark": "prefill", "model": {"shape": a.family, "layers": a.layers, "experts": n_expert,
                                                        "hidden": shape["hidden_size"]},
                      "limits": list(limits.values()), "results": out,
                      "targets": {"memory_ratio (<= 64 tokens)": round(1 / 1.5, 3), "fma_ratio (>= 512 tokens)": 0.5,
                                  "ratio_to_floor (budget)": 1.3}}, indent=2))


if __name__ == "__main__":
    main()
