"""The sampling flags that run, generate and chat share, and the request fields they make."""

import click


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
