"""Commands that run without the daemon: `run` (in-process, one-shot generation) and
`demo-model`. The heavy packages are imported inside the commands."""

import json
import os
import sys
import time

import click

from . import exitcodes

# one BLAS thread and passive OpenMP waits, before numpy is first imported
for _var, _val in {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
                   "OMP_WAIT_POLICY": "PASSIVE", "TOKENIZERS_PARALLELISM": "false"}.items():
    os.environ.setdefault(_var, _val)


def fail(message: str, code: int):
    """Print one line to stderr and exit with code."""
    click.echo(f"colictl: {message}", err=True)
    raise SystemExit(code)


def error_code(e: Exception) -> int:
    from ..engine.errors import InvalidRequest
    from ..storage.errors import CheckpointError

    if isinstance(e, InvalidRequest):
        return exitcodes.BAD_REQUEST
    if isinstance(e, CheckpointError):
        return exitcodes.MODEL
    return exitcodes.INTERNAL


def read_prompt(prompt: str | None) -> str:
    if prompt is not None and prompt != "-":
        return prompt
    if sys.stdin is None or sys.stdin.isatty():
        fail("no prompt: give PROMPT or pipe it on stdin", exitcodes.USAGE)
    return sys.stdin.read()


def resolve_model(model: str | None) -> str:
    """The model directory: --model, else the demo model (written on first use)."""
    if model:
        return model
    from ..engine.demo import default_demo_path, write_demo_model

    path = default_demo_path()
    if not os.path.isfile(os.path.join(path, "config.json")):
        click.echo(f"colictl: writing the demo model to {path}", err=True)
        write_demo_model(path, force=True)
    return path


@click.command()
@click.option("--model", "model_path", metavar="DIR", help="model directory (default: the built-in demo model)")
@click.option("--max-tokens", type=int, default=128, show_default=True, help="most tokens to generate")
@click.option("--temperature", type=float, default=0.0, show_default=True, help="0 = greedy")
@click.option("--top-k", type=int, default=0, show_default=True, help="sample from the k likeliest (0 = off)")
@click.option("--top-p", type=float, default=1.0, show_default=True, help="nucleus sampling mass (1 = off)")
@click.option("--seed", type=int, default=None, help="random seed: the same seed gives the same text")
@click.option("--stop", multiple=True, metavar="STR", help="stop when this string is generated (repeatable)")
@click.option("--chat", is_flag=True, help="wrap the prompt as one user message in the model's chat template")
@click.option("--json", "as_json", is_flag=True, help="print one JSON object instead of streaming text")
@click.argument("prompt", required=False)
def run(model_path, max_tokens, temperature, top_k, top_p, seed, stop, chat, as_json, prompt):
    """Generate text in this process (no daemon). PROMPT, or stdin when absent or '-'."""
    try:
        _run(model_path, max_tokens, temperature, top_k, top_p, seed, stop, chat, as_json, prompt)
    except SystemExit:
        raise
    except KeyboardInterrupt:
        fail("interrupted", exitcodes.INTERRUPTED)
    except BrokenPipeError:
        sys.stderr.close()  # the reader went away (e.g. `| head`): nothing more to say
        raise SystemExit(exitcodes.OK) from None
    except Exception as e:
        from ..storage.errors import ColibriError

        if isinstance(e, ColibriError):
            fail(str(e), error_code(e))
        if isinstance(e, OSError):
            fail(f"{e.strerror or e}{': ' + e.filename if e.filename else ''}", exitcodes.MODEL)
        raise


def _run(model_path, max_tokens, temperature, top_k, top_p, seed, stop, chat, as_json, prompt):
    from ..engine import layers
    from ..engine.generate import SamplingParams, check_prompt, generate
    from ..engine.registry import load_model
    from ..engine.tokenizer import Tokenizer, eos_ids

    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                            stop=tuple(stop))
    params.check()
    text_in = read_prompt(prompt)
    path = resolve_model(model_path)
    t0 = time.perf_counter()
    tok = Tokenizer(path)
    model = load_model(path)
    layers.init()  # compiles the kernels on a machine's first run
    load_s = time.perf_counter() - t0
    if chat:
        ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": text_in}]), special=False)
    else:
        ids = tok.encode(text_in)
    check_prompt(ids, model.n_ctx)
    info = model.describe()
    if not as_json:
        click.echo(f"[colibri] {info['model_type']} from {path}: {info['n_layer']} layers, "
                   f"{info['n_expert']} experts, weights {info['dtype']}, loaded in {load_s:.2f} s", err=True)
    token_ids, pieces, done = [], [], None
    for ev in generate(model, ids, params, eos_ids(path, _config(path), tok), tok):
        if ev.kind == "token":
            token_ids.append(ev.token_id)
        if ev.text:
            pieces.append(ev.text)
            if not as_json:
                sys.stdout.write(ev.text)
                sys.stdout.flush()
        if ev.kind == "done":
            done = ev
    stats = done.stats | {"load_s": round(load_s, 3), "model": info}
    if as_json:
        out = {"prompt_token_ids": ids, "token_ids": token_ids, "text": "".join(pieces),
               "finish_reason": done.finish_reason, "stats": stats}
        sys.stdout.write(json.dumps(out) + "\n")
    else:
        sys.stdout.write("\n")
        rate = f"{stats['decode_tok_s']:.1f} tok/s" if stats["decode_tok_s"] else "-"
        click.echo(f"[colibri] {stats['n_prompt_tokens']} prompt tokens in {stats['prefill_s']:.3f} s, "
                   f"{stats['n_generated_tokens']} generated in {stats['decode_s']:.3f} s ({rate}), "
                   f"finish: {done.finish_reason}", err=True)
    sys.stdout.flush()


def _config(path: str) -> dict:
    from ..storage.checkpoint import load_config

    return load_config(path)


@click.command("demo-model")
@click.argument("directory")
@click.option("--force", is_flag=True, help="replace DIRECTORY if it exists")
def demo_model(directory, force):
    """Write the built-in demo model (small, random, deterministic) to DIRECTORY."""
    from ..engine.demo import write_demo_model

    try:
        path = write_demo_model(directory, force=force)
    except FileExistsError as e:
        fail(f"{e} (use --force to replace it)", exitcodes.USAGE)
    except OSError as e:
        fail(f"cannot write {directory}: {e.strerror or e}", exitcodes.INTERNAL)
    click.echo(path)
