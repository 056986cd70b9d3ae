"""Commands that run without the daemon: `run` (in-process, one-shot generation) and
`demo-model`. The heavy packages are imported inside the commands."""

import json
import os
import sys
import time

import click

from ..storage.policy import POLICIES
from . import exitcodes
from .options import BadInput, NoPrompt, input_errors_option, read_prompt, sampling_options, text_arg

# one BLAS thread and passive OpenMP waits, before numpy is first imported
for _var, _val in {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
                   "OMP_WAIT_POLICY": "PASSIVE", "TOKENIZERS_PARALLELISM": "false"}.items():
    os.environ.setdefault(_var, _val)


def fail(message: str, code: int):
    """Print one line to stderr and exit with code."""
    click.echo(f"colictl: {message}", err=True)
    raise SystemExit(code)


def error_code(e: Exception) -> int:
    """The exit code for a named error (the first matching class, most specific first)."""
    from ..daemon.config import ConfigError
    from ..engine.errors import InvalidRequest
    from ..storage.convert import ConvertError
    from ..storage.errors import BudgetInvalid, CheckpointError, ExpertReadError
    from ..storage.layout import TraceInvalid
    from ..storage.sessions import SessionMismatch
    from ..storage.staging import StageError

    table = [(InvalidRequest, exitcodes.BAD_REQUEST), (BudgetInvalid, exitcodes.BAD_REQUEST),
             (SessionMismatch, exitcodes.BAD_REQUEST), (TraceInvalid, exitcodes.BAD_REQUEST),
             (StageError, exitcodes.CHECK_FAILED),
             (ConvertError, exitcodes.USAGE), (ConfigError, exitcodes.USAGE), (ExpertReadError, exitcodes.MODEL), (CheckpointError, exitcodes.MODEL)]
    return next((code for cls, code in table if isinstance(e, cls)), exitcodes.INTERNAL)


def setup_logging() -> None:
    """The engine's and storage's warnings as they happen, one line each on stderr. Their
    errors are not printed here: each also ends the command as an exception, which
    `guarded` prints once."""
    import logging

    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("colictl: %(levelname)s %(message)s"))
    handler.addFilter(lambda record: record.levelno < logging.ERROR)
    root = logging.getLogger("colibri")
    root.handlers[:] = [handler]
    root.setLevel(logging.WARNING)


def guarded(fn):
    """Run a command body: named errors become one line and an exit code, never a traceback."""
    import functools

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        setup_logging()
        try:
            return fn(*args, **kwargs)
        except SystemExit:
            raise
        except KeyboardInterrupt:
            fail("interrupted", exitcodes.INTERRUPTED)
        except BrokenPipeError:
            sys.stderr.close()  # the reader went away (e.g. `| head`): nothing more to say
            raise SystemExit(exitcodes.OK) from None
        except NoPrompt as e:
            fail(str(e), exitcodes.USAGE)
        except BadInput as e:
            fail(str(e), exitcodes.BAD_REQUEST)
        except Exception as e:
            from ..storage.errors import ColibriError

            if isinstance(e, ColibriError):
                fail(str(e), error_code(e))
            if isinstance(e, OSError):
                fail(f"{e.strerror or e}{': ' + str(e.filename) if e.filename else ''}", exitcodes.MODEL)
            raise

    return wrapper


def resolve_model(model: str | None) -> str:
    """The model directory: --model, else the demo model (written and converted on first use,
    in the same place the daemon keeps it)."""
    if model:
        return model
    from ..engine.registry import build_model
    from ..storage.demo import default_demo_path, ensure_demo_container

    path = default_demo_path()
    return ensure_demo_container(path, build_model, lambda phase: click.echo(f"colictl: {phase} ({path})", err=True))


@click.command()
@click.option("--model", "model_path", metavar="DIR", help="model directory (default: the built-in demo model)")
@sampling_options(max_tokens=128)
@click.option("--stop", multiple=True, metavar="STR", help="stop when this string is generated (repeatable)")
@click.option("--chat", is_flag=True, help="wrap the prompt as one user message in the model's chat template")
@click.option("--json", "as_json", is_flag=True, help="print one JSON object instead of streaming text")
@click.argument("prompt", required=False)
@click.option("--expert-cache", "budget", metavar="SIZE",
              help="RAM for routed experts of a container: bytes, KiB/MiB/GiB, 'min' or 'all' "
                   "(default: all that fits in half the available memory)")
@click.option("--io-threads", type=click.IntRange(1, 64), default=2, show_default=True,
              help="threads reading experts from disk")
@click.option("--table-cache", "table_budget", metavar="SIZE",
              help="RAM for a container's streamed embedding tables (Qwen4-Exp's n-gram tables): bytes or "
                   "KiB/MiB/GiB, min or all (read in), their pages read as tokens index them (default: all of "
                   "them if that fits in a quarter of the available memory, else that quarter)")
@click.option("--reader", type=click.Choice(["preadv", "io_uring", "auto"]), default="preadv", show_default=True,
              help="expert reads: the preadv pool, io_uring (colibri[uring]), or auto (the faster, measured)")
@click.option("--drive", "drives", multiple=True, type=click.Path(file_okay=False, exists=True), metavar="DIR",
              help="a copy of the expert files on another drive (colictl drives stage), sharing the reads "
                   "(repeatable)")
@click.option("--threads", type=click.IntRange(0, 1024), default=0, show_default=True,
              help="threads computing (0: every CPU this process may run on)")
@click.option("--mlock", is_flag=True, help="lock the expert cache in RAM (within RLIMIT_MEMLOCK)")
@click.option("--routing-trace", type=click.Path(dir_okay=False, writable=True), metavar="PATH",
              help="write the experts each layer used at each step as JSON lines")
@click.option("--prefetch", type=click.IntRange(0, 1024), default=8, show_default=True, metavar="N",
              help="router lookahead: start up to N reads per token of the step for the next layer's predicted experts (0: off)")
@click.option("--policy", type=click.Choice(POLICIES), default="learned", show_default=True,
              help="expert cache policy (README: The expert cache policy)")
@click.option("--history", "history_dir", type=click.Path(file_okay=False), metavar="DIR",
              help="keep the usage history in DIR/history (read at start, written at the end); default: none")
@click.option("--history-read-only", is_flag=True, help="read the usage history but never write it")
@click.option("--session", "session_file", type=click.Path(dir_okay=False), metavar="FILE",
              help="continue the conversation saved in FILE (started when absent): PROMPT is appended to it as "
                   "text, only its new tokens are computed, and FILE is rewritten after the turn")
@click.option("--activations", type=click.Choice(["auto", "float32", "int8"]), default="auto", show_default=True,
              help="int8: int8/int4 experts multiply activations quantised to 8 bits (integer dot products; lossy, "
                   "and said so); float32: exact; auto: as the container was converted")
@input_errors_option
@guarded
def run(model_path, max_tokens, temperature, top_k, top_p, seed, stop, chat, as_json, prompt, budget, io_threads,
        table_budget, reader, drives, threads, mlock, routing_trace, prefetch, policy, history_dir, history_read_only, session_file,
        activations, input_errors):
    """Generate text in this process (no daemon). PROMPT, or stdin when absent or '-'."""
    from ..engine import layers
    from ..engine.errors import InvalidRequest
    from ..engine.generate import SamplingParams, check_prompt, generate
    from ..engine.registry import build_model
    from ..engine.tokenizer import Tokenizer, eos_ids
    from ..storage.gguf import tokenizer_spec
    from ..storage.placement import Placement, faults_from_env, open_model
    from ..storage.policy import Policy
    from ..storage.sizes import parse_size

    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                            stop=tuple(text_arg(s, input_errors, "--stop") for s in stop))
    params.check()
    budget = parse_size(budget) if budget is not None else None
    text_in = read_prompt(prompt, input_errors)
    path = resolve_model(model_path)
    t0 = time.perf_counter()
    trace = open(routing_trace, "w") if routing_trace else None  # noqa: SIM115 (closed at exit)
    placement = Placement(budget=budget, io_threads=io_threads, reader=reader, drives=drives, mlock=mlock, trace=trace,
                          table_budget=parse_size(table_budget) if table_budget is not None else None,
                          policy=Policy(name=policy, prefetch_reads=prefetch), state_dir=history_dir,
                          history_read_only=history_read_only, faults=faults_from_env())
    tokenizers = []  # loaded once the files' checks pass, before a weight is read

    def checked(model):
        tok = Tokenizer(path, tokenizer_spec(path))
        limit = tok.most_bytes(model.n_ctx)  # a prompt that cannot fit is refused before it is tokenised
        if len(text_in.encode("utf-8", "surrogatepass")) > limit:
            raise InvalidRequest(f"the prompt is {len(text_in.encode('utf-8', 'surrogatepass'))} bytes: far more "
                                 f"than the model's context of {model.n_ctx} tokens takes (at most {limit} bytes)")
        tokenizers.append(tok)

    placed = open_model(path, placement, build_model, checked=checked)
    model, tok = placed.model, tokenizers[0]
    if activations != "auto":
        model.set_activations(activations)
    layers.init(threads or None, kinds=model.kernel_kinds())  # compiles its kernels on a machine's first run
    load_s = time.perf_counter() - t0
    prior, keys, messages = None, None, [{"role": "user", "content": text_in}]
    saved = None
    if session_file:
        from ..storage.sessions import chat_messages, fingerprints, load_session

        keys = fingerprints(path)
        saved = load_session(session_file, *keys, model.args.vocab_size)
        mode = saved[2].get("mode", "text") if saved else ("chat" if chat else "text")
        if mode != ("chat" if chat else "text"):
            raise click.UsageError(f"{session_file} is a {mode} session: continue it "
                                   f"{'with' if mode == 'chat' else 'without'} --chat")
        if saved and chat:
            earlier = chat_messages(saved[2])
            if earlier is not None:
                messages = earlier + messages
            else:
                click.echo(f"[colibri] {session_file}: its chat messages cannot be read; starting afresh", err=True)
                saved = None
    if chat:
        ids = tok.encode(tok.apply_chat_template(messages), special=False)
    else:
        ids = tok.encode(text_in)
    check_prompt(ids, model.n_ctx)
    if saved:
        from ..engine.generate import Conversation

        prior = Conversation(*saved[:2])
        if chat:  # the whole chat rendered again: computed from where it differs from the saved tokens
            prior, ids = prior.continued(ids)
    info = model.describe()
    if not as_json:
        click.echo(f"[colibri] {info['model_type']} from {path}: {info['n_layer']} layers, {info['n_expert']} "
                   f"experts, {info['attention']} attention ({fmt_bytes(info['kv_bytes_per_token'])} of KV cache "
                   f"per token{state_text(info)}), {describe_precision(info['precision'])}, {describe_placement(info['experts'])}, "
                   f"loaded in {load_s:.2f} s", err=True)
    if info.get("note"):
        click.echo(f"[colibri] {info['note']}", err=True)
    token_ids, pieces, done = [], [], None
    for ev in generate(model, ids, params, eos_ids(path, _config(path), tok), tok, prior=prior,
                       keep=bool(session_file)):
        if ev.kind == "token":
            token_ids.append(ev.token_id)
        if ev.text:
            pieces.append(ev.text)
            if not as_json:
                sys.stdout.write(ev.text)
                sys.stdout.flush()
        if ev.kind == "done":
            done = ev
    if placed.history is not None:
        placed.history.save()  # when it has a path and is not read-only
    stats = done.stats | {"load_s": round(load_s, 3), "model": info}
    if session_file and done.conversation is not None:
        from ..storage.sessions import mode_metadata, save_session

        said = messages + [{"role": "assistant", "content": "".join(pieces)}] if chat else None
        save_session(session_file, done.conversation.tokens, done.conversation.kv, *keys, mode_metadata(said))
        stats["session"] = {"file": session_file, "continued_tokens": len(prior.tokens) if prior else 0,
                            "tokens": len(done.conversation.tokens)}
    if as_json:
        out = {"prompt_token_ids": ids, "token_ids": token_ids, "text": "".join(pieces),
               "finish_reason": done.finish_reason, "stats": stats}
        sys.stdout.write(json.dumps(out) + "\n")
        if info["precision"].get("lossy"):  # stdout is the object; the warning still goes where people look
            click.echo(f"[colibri] {describe_precision(info['precision'])}", err=True)
    else:
        sys.stdout.write("\n")
        rate = f"{stats['decode_tok_s']:.1f} tok/s" if stats["decode_tok_s"] else "-"
        click.echo(f"[colibri] {stats['n_prompt_tokens']} prompt tokens in {stats['prefill_s']:.3f} s, "
                   f"{stats['n_generated_tokens']} generated in {stats['decode_s']:.3f} s ({rate}), "
                   f"finish: {done.finish_reason}", err=True)
        e = stats["experts"]
        gbs = f" at {e['read_gbs']:.2f} GB/s" if e["read_gbs"] else ""
        click.echo(f"[colibri] experts: {e['hits']} hits, {e['misses']} misses (hit rate "
                   f"{100 * (e['hit_rate'] or 0):.1f} %), {fmt_bytes(e['bytes_read'])} read{gbs} in "
                   f"{e['read_requests']} requests, "
                   f"{e['experts_read_per_token']} read per token, waiting on I/O {e['io_wait_s']:.3f} s, "
                   f"computing {e['compute_s']:.3f} s", err=True)
        if e["prefetch_issued"]:
            click.echo(f"[colibri] prefetch: {e['prefetch_issued']} reads ahead, {e['prefetch_used']} used, "
                       f"{e['prefetch_wasted']} not chosen (precision {100 * (e['prefetch_precision'] or 0):.0f} %)",
                       err=True)
    sys.stdout.flush()


def state_text(info: dict) -> str:
    """", and N of recurrent state per sequence" for a hybrid's linear layers, else nothing."""
    n = info.get("state_bytes_per_sequence") or 0
    return f" and {fmt_bytes(n)} of recurrent state per sequence" if n else ""


def describe_precision(p: dict) -> str:
    from ..daemon.protocol import precision_text

    return precision_text(p)


def describe_placement(e: dict) -> str:
    if "budget_bytes" not in e:
        return "all experts resident"
    h = e["history"]
    learned = f", usage history of {h['steps']} steps" if h["steps"] else ""
    return (f"expert cache {fmt_bytes(e['arena_bytes'])} ({e['policy']['name']}{learned}, "
            f"{'O_DIRECT' if e['o_direct'] else 'buffered'} reads, {e['io_threads']} I/O threads"
            f"{'' if e.get('checksums', True) else ', no checksums'})")


def fmt_bytes(n: float) -> str:
    from ..storage.sizes import fmt_bytes as fmt

    return fmt(n)


def _config(path: str) -> dict:
    from ..storage.checkpoint import load_config

    return load_config(path)


@click.command("demo-model")
@click.argument("directory")
@click.option("--force", is_flag=True, help="replace DIRECTORY if it exists")
def demo_model(directory, force):
    """Write the built-in demo model (a tiny trained model, the weights shipped with colibri) to
    DIRECTORY as a Hugging Face checkpoint."""
    from ..storage.demo import write_demo_model

    try:
        path = write_demo_model(directory, force=force)
    except FileExistsError as e:
        fail(f"{e} (use --force to replace it)", exitcodes.USAGE)
    except OSError as e:
        fail(f"cannot write {directory}: {e.strerror or e}", exitcodes.INTERNAL)
    click.echo(path)


def grouping(experts: dict) -> str:
    # how the experts' scales are laid out, for the convert line: " g64", " 128x128 blocks"
    if "block" in experts:
        return f" {experts['block'][0]}x{experts['block'][1]} blocks" if experts["block"] else " one scale a matrix"
    return f" g{experts['group_size']}" if experts.get("group_size") else ""


@click.command()
@click.argument("src")
@click.argument("dst")
@click.option("--dtype", type=click.Choice(["bf16", "f16", "f32", "int8", "int4"]),
              help="expert precision (default: the checkpoint's own, FP8 and MXFP4 kept as published). "
                   "bf16/f16/f32 apply to the dense part too; int8/int4 quantize the routed experts only; "
                   "either from FP8 or MXFP4, or int8/int4 from any, is lossy")
@click.option("--group-size", type=click.Choice(["32", "64", "128"]),
              help="values per scale for int8/int4 (default: int4 64, int8 one scale per row)")
@click.option("--dense-dtype", type=click.Choice(["bf16", "f16", "f32", "int8", "int4"]),
              help="precision of the resident part (default: the checkpoint's own); int8/int4: its attention "
                   "matrices and untied LM head only, group 32, on int8 activations (lossy)")
@click.option("--activations", type=click.Choice(["float32", "int8"]),
              help="what the experts compute on unless told otherwise: int8 (integer dot products, lossy, the "
                   "default for --dtype int8/int4), or float32 (exact; the default for every other dtype); "
                   "run --activations and the daemon's activations key override it")
@click.option("--force", is_flag=True, help="replace DST if it exists")
@click.option("--layout", type=click.Choice(["expert-id", "coactivation"]), default="expert-id", show_default=True,
              help="the order of each layer's expert records: by id, or experts chosen together side by side "
                   "(from --trace), so that they are read together")
@click.option("--trace", "trace_path", type=click.Path(exists=True, dir_okay=False), metavar="FILE",
              help="a routing trace (colictl run --routing-trace) for --layout coactivation")
@guarded
def convert(src, dst, dtype, group_size, dense_dtype, activations, force, layout, trace_path):
    """Convert the Hugging Face checkpoint (or GGUF file) SRC into a colibri container DST,
    laid out for streaming experts from disk."""
    from ..engine.registry import build_model
    from ..storage.checkpoint import load_config, open_checkpoint
    from ..storage.container import is_container
    from ..storage.convert import ConvertError, plan_for
    from ..storage.convert import convert as run_convert

    if group_size and dtype not in ("int8", "int4"):
        raise ConvertError("--group-size applies to --dtype int8 or int4")
    if (layout == "coactivation") != (trace_path is not None):
        raise ConvertError("--layout coactivation takes its order from --trace FILE (and --trace only serves it)")
    if is_container(src):
        raise ConvertError(f"{src} is already a colibri container: convert takes a Hugging Face checkpoint "
                           "or a GGUF file (run the container as it is)")
    cfg = load_config(src)
    model = build_model(src, cfg)
    ckpt = model.source(open_checkpoint(src))
    model.check(ckpt)
    plan = plan_for(model)
    order = None
    if trace_path:
        from ..storage.layout import coactivation_order

        ids, fp = coactivation_order(trace_path, model.moe_layers, model.n_expert)
        order = {"layout": "coactivation", "source": fp, "experts": ids}
    bar = sys.stderr.isatty()
    t0 = time.perf_counter()

    def progress(done, total):
        if bar and (done == total or done % 16 == 0):
            width = 40
            fill = width * done // total
            sys.stderr.write(f"\rconverting [{'#' * fill}{'.' * (width - fill)}] {done}/{total} tensors and experts")
            sys.stderr.flush()

    manifest = run_convert(ckpt, dst, plan, expert_dtype=dtype, dense_dtype=dense_dtype,
                           group_size=int(group_size) if group_size else None, force=force, progress=progress,
                           order=order, activations=activations)
    if bar:
        sys.stderr.write("\n")
    ex = manifest["experts"]
    tc = manifest["tensor_classes"]
    click.echo(f"[colibri] {os.path.abspath(dst)}: {ex['n_layer']} MoE layers x {ex['n_expert']} experts of "
               f"{fmt_bytes(ex['record_bytes'])} ({tc['experts']['dtype']}{grouping(tc['experts'])}), dense "
               f"{dense_text(tc['dense'])}, in {time.perf_counter() - t0:.1f} s", err=True)


def dense_text(d: dict) -> str:
    """A container's dense precision as convert wrote it: "int8 g32 (16 matrices; the rest bf16)"."""
    fp8 = " + " + "/".join(d["fp8"]) if d.get("fp8") else ""
    q = d.get("int")
    if not q:
        return d["dtype"] + fp8
    return (f"{q['kind']} g{q['group_size']} ({len(q['names'])} matri{'x' if len(q['names']) == 1 else 'ces'}; "
            f"the rest {d['dtype']}{fp8})")


def with_copy_bar(c, label: str, job):
    """job(progress) under a progress bar over the bytes a drive's copy holds, on stderr when
    it is a terminal; job's result."""
    if not sys.stderr.isatty():
        return job(None)
    from ..storage.staging import file_bytes, staged_files

    total = sum(file_bytes(c, f) for f in staged_files(c))
    with click.progressbar(length=total, label=label, file=sys.stderr, show_eta=True, width=36) as bar:
        return job(bar.update)


def open_model_container(model_path: str | None):
    from ..storage.container import ContainerInvalid, is_container, open_container

    path = resolve_model(model_path)
    if not is_container(path):
        raise ContainerInvalid(f"{path} is a Hugging Face checkpoint: its experts are not streamed, there is "
                               "nothing to stage (colictl convert it first)")
    return open_container(path)


@click.command("stage")
@click.option("--model", "model_path", metavar="DIR", help="the container (default: the built-in demo model's)")
@click.argument("dest")
@guarded
def drives_stage(model_path, dest):
    """Copy the container's expert files (and streamed tables) to DEST on another drive
    (resumable; every record checked against the manifest, the copy read back from the drive). Then add DEST to
    `drives:` in colibri.yaml and the daemon shares its reads with it."""
    from ..storage.staging import stage

    c = open_model_container(model_path)
    got = with_copy_bar(c, f"staging into {dest}", lambda progress: stage(c, dest, progress))
    click.echo(f"[colibri] {dest}: {len(got['copied'])} files copied and read back, {len(got['kept'])} "
               f"already there, in {got['seconds']:.1f} s; add it to drives: in colibri.yaml", err=True)


@click.command("verify")
@click.option("--model", "model_path", metavar="DIR", help="the container (default: the built-in demo model's)")
@click.option("--json", "as_json", is_flag=True, help="one JSON object")
@click.argument("dest")
@guarded
def drives_verify(model_path, as_json, dest):
    """Check the copies of the expert files (and streamed tables) in DEST against the container's manifest, every
    record read from the drive. Exit 7 when one does not match."""
    from ..storage.staging import verify

    c = open_model_container(model_path)
    got = with_copy_bar(c, f"verifying {dest}", lambda progress: verify(c, dest, progress))
    if as_json:
        click.echo(json.dumps(got))
    else:
        for name, what in got["files"].items():
            for line in what if isinstance(what, list) else [what]:
                click.echo(f"{name}: {line}")
        staged = sum(v != "missing" for v in got["files"].values())
        click.echo(f"{dest}: {staged} of {len(got['files'])} files staged, {got['bad']} damaged")
    if got["bad"]:
        raise SystemExit(exitcodes.CHECK_FAILED)
