"""The sampling flags that run, generate and chat share, and the request fields they make;
the model argument of the offline commands."""

import functools

import click


def model_argument(help: str):
    """The model a command works on, as convert takes it (a positional MODEL) or as --model
    MODEL; the command gets it as `model_path` (None: neither given)."""

    def decorate(fn):
        @functools.wraps(fn)
        def wrapper(*args, model=None, model_path=None, **kwargs):
            if model and model_path and model != model_path:
                raise click.UsageError(f"two models given: {model} and --model {model_path}")
            return fn(*args, model_path=model or model_path, **kwargs)

        wrapper = click.argument("model", required=False, metavar="[MODEL]")(wrapper)
        return click.option("--model", "model_path", metavar="PATH", help=help + " (or as the argument MODEL)")(wrapper)

    return decorate


def sampling_options(max_tokens: int):
    """--max-tokens (default `max_tokens`), --temperature, --top-k, --top-p, --seed."""
    flags = [
        click.option("--max-tokens", type=int, default=max_tokens, show_default=True, help="most tokens to generate"),
        click.option("--temperature", type=float, default=0.0, show_default=True, help="0 = greedy"),
        click.option("--top-k", type=int, default=0, show_default=True, help="sample from the k likeliest (0 = off)"),
        click.option("--top-p", type=float, default=1.0, show_default=True, help="nucleus sampling mass (1 = off)"),
        click.option("--seed", type=int, default=None, help="random seed: the same seed gives the same text"),
    ]

    def decorate(fn):
        for flag in reversed(flags):
            fn = flag(fn)
        return fn

    return decorate


def sampling_fields(max_tokens, temperature, top_k, top_p, seed) -> dict:
    """The sampling fields of a generate request (seed only when given)."""
    fields = {"max_tokens": max_tokens, "temperature": temperature, "top_k": top_k, "top_p": top_p}
    if seed is not None:
        fields["seed"] = seed
    return fields


class BadInput(Exception):
    """Input text that is not valid UTF-8 (and --input-errors is strict)."""


def input_errors_option(fn):
    """--input-errors strict|replace."""
    return click.option("--input-errors", type=click.Choice(["strict", "replace"]), default="strict",
                        show_default=True,
                        help="bytes of the prompt (stdin or an argument) that are not UTF-8: strict refuses them "
                             "(exit 4), replace puts U+FFFD in their place")(fn)


def decode_text(data: bytes, errors: str, what: str) -> str:
    """`data` as UTF-8 text. Raises BadInput naming the first bad byte and its offset,
    unless errors is "replace"."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        if errors == "replace":
            return data.decode("utf-8", "replace")
        raise BadInput(f"{what} is not valid UTF-8: byte 0x{data[e.start]:02x} at offset {e.start} "
                       "(--input-errors replace puts U+FFFD in place of such bytes)") from None


def text_arg(value: str | None, errors: str, what: str) -> str | None:
    """A command-line argument as UTF-8 text (the shell hands over bytes; Python keeps the
    ones that are not UTF-8 as surrogates). Raises BadInput."""
    import os

    return None if value is None else decode_text(os.fsencode(value), errors, what)


def read_stdin(errors: str) -> str:
    """All of stdin as UTF-8 text. Raises BadInput."""
    import sys

    return decode_text(sys.stdin.buffer.read(), errors, "stdin")


def read_prompt(prompt: str | None, errors: str) -> str:
    """The prompt: the argument, else stdin (when absent or '-'). Raises BadInput, and
    NoPrompt when there is none or it is empty."""
    import sys

    if prompt is not None and prompt != "-":
        text = text_arg(prompt, errors, "the prompt argument")
    elif sys.stdin is None or sys.stdin.isatty():
        raise NoPrompt("no prompt: give PROMPT or pipe it on stdin")
    else:
        text = read_stdin(errors)
    if not text:
        raise NoPrompt("no prompt: the prompt is empty")
    return text


class NoPrompt(Exception):
    """No prompt given, or an empty one."""
