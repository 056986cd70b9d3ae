"""Generation: prefill, then decode one token at a time with the KV cache, as a stream
of events. Sampling: greedy, temperature, top-k, top-p, seeded. Stops on EOS ids, stop
strings and max_tokens (and at the end of the model's context)."""

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from .errors import InvalidRequest, PromptTooLong


@dataclass
class SamplingParams:
    max_tokens: int = 128
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    seed: int | None = None
    stop: tuple[str, ...] = ()

    def check(self) -> None:
        """Raise InvalidRequest naming the first value out of range."""
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise InvalidRequest(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not np.isfinite(self.temperature) or self.temperature < 0:
            raise InvalidRequest(f"temperature must be >= 0, got {self.temperature!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise InvalidRequest(f"top_k must be >= 0 (0 = off), got {self.top_k!r}")
        if not (0 < self.top_p <= 1):
            raise InvalidRequest(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or self.seed < 0):
            raise InvalidRequest(f"seed must be a non-negative integer, got {self.seed!r}")
        if any(not s for s in self.stop):
            raise InvalidRequest("stop strings must not be empty")


class Sampler:
    """Picks the next token from logits; the same seed gives the same choices."""

    def __init__(self, p: SamplingParams):
        self.p = p
        self.rng = np.random.default_rng(p.seed)

    def __call__(self, logits: np.ndarray) -> int:
        # logits [V] f32
        p = self.p
        if p.temperature == 0:
            return int(np.argmax(logits))
        z = logits.astype(np.float64) / p.temperature
        if 0 < p.top_k < z.shape[0]:
            kth = np.partition(z, -p.top_k)[-p.top_k]
            z = np.where(z < kth, -np.inf, z)
        probs = np.exp(z - z.max())
        probs /= probs.sum()
        if p.top_p < 1.0:
            order = np.argsort(-probs, kind="stable")
            cum = np.cumsum(probs[order])
            keep = order[: int(np.searchsorted(cum, p.top_p) + 1)]  # the smallest set reaching top_p
            mask = np.zeros_like(probs)
            mask[keep] = probs[keep]
            probs = mask / mask.sum()
        return int(self.rng.choice(probs.shape[0], p=probs))


class TextStream:
    """Turns generated ids into text deltas: never splits a UTF-8 character, holds back
    text that may be the start of a stop string, and finds stop strings across tokens."""

    def __init__(self, tokenizer, stop: tuple[str, ...]):
        self.tok, self.stop = tokenizer, stop
        self.ids: list[int] = []
        self.prefix, self.read = 0, 0  # token offsets, as in text-generation-inference
        self.text = ""  # all decoded text
        self.sent = 0  # characters of self.text already emitted

    def push(self, token_id: int) -> tuple[str, bool]:
        """Add a token; return (text to emit now, whether a stop string was hit)."""
        self.ids.append(token_id)
        before = self.tok.decode(self.ids[self.prefix : self.read])
        after = self.tok.decode(self.ids[self.prefix :])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.text += after[len(before) :]
            self.prefix, self.read = self.read, len(self.ids)
        for s in self.stop:
            i = self.text.find(s, max(0, self.sent - len(s)))
            if i >= 0:
                out, self.sent = self.text[self.sent : i], len(self.text)
                self.text = self.text[:i]
                return out, True
        hold = max((n for s in self.stop for n in range(1, len(s)) if self.text.endswith(s[:n])), default=0)
        end = len(self.text) - hold
        out = self.text[self.sent : end] if end > self.sent else ""
        self.sent = max(self.sent, end)
        return out, False

    def flush(self) -> str:
        out, self.sent = self.text[self.sent :], len(self.text)
        return out


@dataclass
class Event:
    kind: str  # "token" or "done"
    token_id: int = -1
    text: str = ""
    finish_reason: str = ""  # "stop" or "length", with kind "done"
    stats: dict = field(default_factory=dict)


def expert_stats(st, n_tokens: int, wall_s: float) -> dict:
    """The expert source's counters for a run, with per-token and time splits added."""
    d = st.as_dict()
    d["experts_read_per_token"] = round(st.misses / n_tokens, 3) if n_tokens else None
    d["compute_s"] = round(max(wall_s - st.io_wait_s, 0.0), 6)
    return d


def check_prompt(prompt_ids: list[int], n_ctx: int) -> None:
    """Raise InvalidRequest for an empty prompt, PromptTooLong for one that leaves no room
    in the context for a new token."""
    if not prompt_ids:
        raise InvalidRequest("the prompt is empty")
    if len(prompt_ids) >= n_ctx:
        raise PromptTooLong(f"the prompt has {len(prompt_ids)} tokens; the model's context is {n_ctx}")


def generate(model, prompt_ids, params: SamplingParams, eos_ids=(), tokenizer=None) -> Iterator[Event]:
    """Generate from prompt_ids, yielding a "token" event per new token and one "done".

    Raises InvalidRequest (bad parameters, empty prompt) or PromptTooLong before any work.
    """
    params.check()
    prompt_ids = [int(i) for i in prompt_ids]
    check_prompt(prompt_ids, model.n_ctx)
    n_prompt = len(prompt_ids)
    eos = set(int(i) for i in eos_ids)
    sampler = Sampler(params)
    text = TextStream(tokenizer, tuple(params.stop)) if tokenizer is not None else None
    cache = model.new_cache(n_prompt + params.max_tokens)
    stats0 = model.experts.stats.copy()

    t0 = time.perf_counter()
    logits = model.forward(np.asarray(prompt_ids), cache)[-1]  # [V]
    t1 = time.perf_counter()
    prefill_s = t1 - t0
    n_gen, finish = 0, "length"
    while True:
        tok = sampler(logits)
        n_gen += 1
        if tok in eos:
            finish = "stop"
            yield Event("token", tok)
            break
        delta, hit = text.push(tok) if text else ("", False)
        yield Event("token", tok, delta)
        if hit:
            finish = "stop"
            break
        if n_gen >= params.max_tokens or cache.n_pos >= cache.n_ctx:
            break
        logits = model.forward(np.asarray([tok]), cache)[-1]
    decode_s = time.perf_counter() - t1
    n_decode = max(n_gen - 1, 0)  # the first token comes from the prefill
    yield Event(
        "done",
        text=text.flush() if text else "",
        finish_reason=finish,
        stats={
            "n_prompt_tokens": n_prompt,
            "n_generated_tokens": n_gen,
            "prefill_s": round(prefill_s, 6),
            "prefill_tok_s": round(n_prompt / prefill_s, 3) if prefill_s > 0 else None,
            "decode_s": round(decode_s, 6),
            "decode_tok_s": round(n_decode / decode_s, 3) if decode_s > 0 and n_decode else None,
            "experts": expert_stats(model.experts.stats.minus(stats0), n_prompt + n_decode, prefill_s + decode_s),
        },
    )
