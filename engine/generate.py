"""Generation: prefill, then decode one token at a time with the KV cache, as a stream
of events. Sampling: greedy, temperature, top-k, top-p, seeded. Stops on EOS ids, stop
strings and max_tokens (and at the end of the model's context)."""

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from .errors import InvalidRequest, PromptTooLong
from .jit import compile_seconds
from .sequence import KV_BLOCK as BLOCK


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
    conversation: "Conversation | None" = None  # with kind "done", for a request that keeps it


@dataclass
class Conversation:
    """A conversation between two turns (what a session keeps): its tokens, the last one
    sampled and not yet fed to the model, and the KV cache of all the others
    (KVCache.snapshot). The next turn feeds that last token and the new prompt on top of
    the restored cache: its rows are computed as if the whole conversation had been one
    request, its earlier prompts in one step each and each sampled token a step of its own."""

    tokens: list[int]
    kv: dict  # may hold more positions than len(tokens) - 1: the request keeps only those

    def continued(self, tokens: list[int]) -> tuple["Conversation", list[int]]:
        """(prior, new tokens) for a turn whose whole conversation, rendered afresh (a chat
        template's messages), is `tokens`: the longest common prefix with this conversation
        keeps its cache, what follows is fed. A template that renders an earlier turn
        differently (or the reply re-tokenized otherwise) costs only the positions after
        the first difference."""
        fed = len(self.tokens) - 1  # positions in the cache
        same = 0
        for a, b in zip(self.tokens, tokens):
            if a != b:
                break
            same += 1
        keep = min(same, fed, len(tokens) - 1)  # positions kept; tokens[keep] is fed next
        return Conversation(tokens[: keep + 1], self.kv), tokens[keep + 1 :]


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


class Request:
    """One generation in a Batcher: its own KV cache, sampler and text; advances one step
    each time the batcher steps: its prompt (whole, or a chunk at a time), then one token."""

    def __init__(self, model, prompt_ids, params: SamplingParams, eos_ids=(), tokenizer=None, rid=None,
                 prior: Conversation | None = None, keep: bool = False):
        # prior: a conversation this request continues (prompt_ids its new turn); keep: its
        # done event carries the conversation after it (Event.conversation)
        params.check()
        new = [int(i) for i in prompt_ids]
        if prior is None:
            check_prompt(new, model.n_ctx)  # (a continuation always feeds the last sampled token)
        self.prior, self.keep = prior, keep
        before = prior.tokens[:-1] if prior is not None else []  # the tokens in the restored cache
        self.prompt_ids = (prior.tokens[-1:] if prior is not None else []) + new  # what this request feeds
        if len(before) + len(self.prompt_ids) >= model.n_ctx:
            raise PromptTooLong(f"the conversation has {len(before) + len(self.prompt_ids)} tokens; the model's "
                                f"context is {model.n_ctx}")
        self.id = rid
        self.params = params
        self.eos = {int(i) for i in eos_ids}
        self.sampler = Sampler(params)
        self.text = TextStream(tokenizer, tuple(params.stop)) if tokenizer is not None else None
        self.cache = model.new_cache(len(before) + len(self.prompt_ids) + params.max_tokens)
        if prior is not None:
            try:
                self.cache.restore(prior.kv, len(before))
            except ValueError as e:
                raise InvalidRequest(f"the conversation's saved state does not fit this model: {e}") from None
        self.generated: list[int] = []
        self.last = -1  # the token to feed next step (-1: the prompt)
        self.fed = 0  # prompt tokens already in the KV cache
        self.n_gen = 0
        self.finish = ""  # set when done
        self.cancelled = False
        self.t_start = self.t_first = self.t_end = None
        self.c_start = self.c_first = 0.0  # kernels compiled at first use by then (jit.compile_seconds): not the model's speed
        self.stats0 = model.experts.stats.copy()
        self.prefix = None  # the batcher's prefix cache, when it has one
        self.held: list = []  # its blocks this request started from (held until it ends)
        self.cached = 0  # prompt tokens taken from the prefix cache, not computed
        self.pauses: list[int] = []  # a hybrid's prompt positions where a step ends, its state kept there
        self.kept: tuple[int, dict] | None = None  # a hybrid's state at its last block boundary while it decodes

    def use_prefix(self, prefix) -> None:
        """Start from the longest prefix of the prompt that `prefix` (engine/prefix.py) holds,
        and give it this request's blocks as they are computed. A continued conversation
        (prior) already starts from its own cache and is left alone."""
        from .prefix import load_blocks, pause_points

        self.prefix = prefix
        if self.prior is None:
            reach = prefix.reach(self.prompt_ids, self.cache.pool) if self.cache.state else 0
            self.held = prefix.match(self.prompt_ids, self.cache.pool, bool(self.cache.state))
            load_blocks(self.cache, self.held)
            self.fed = self.cached = self.cache.n_pos
            if self.cache.state:
                self.pauses = [p for p in pause_points(len(self.prompt_ids), prefix.snapshot_tokens, reach)
                               if p > self.fed]

    def close(self, model) -> None:
        """The request ends: its blocks go to the prefix cache (its prompt's, and its
        sampled tokens' where their rows are the prompt rows' bits), and it lets go of the
        ones it held."""
        if self.prefix is None:
            return
        if self.prior is None and not self.prefilling and model.DECODE_ROWS_EXACT:
            tokens = self.prompt_ids + self.generated[:-1]
            self.prefix.insert(tokens, self.cache, self.cache.n_pos)
            if self.kept is not None:  # the reply's last block boundary: a resent conversation resumes there
                self.prefix.insert(tokens, self.cache, *self.kept)
        self.prefix.release(self.held)
        self.prefix, self.held = None, []

    @property
    def done(self) -> bool:
        return bool(self.finish)

    @property
    def prefilling(self) -> bool:
        return self.last < 0

    def feed(self, limit: int | None = None) -> list[int]:
        """The tokens of this step: the rest of the prompt (at most `limit` of them), then
        the last sampled token."""
        if not self.prefilling:
            return [self.last]
        end = len(self.prompt_ids) if limit is None else min(self.fed + limit, len(self.prompt_ids))
        if self.pauses:  # (a hybrid's state is kept where its prompt pauses: the step ends there)
            end = min(end, next((p for p in self.pauses if p > self.fed), end))
        return self.prompt_ids[self.fed : end]

    def advance(self, logits: np.ndarray, n_fed: int) -> list[Event]:
        # logits [V] of this request's last row after a step that fed it n_fed tokens -> its
        # events for this step (none while its prompt is not all in)
        if self.prefilling:
            self.fed += n_fed
            if self.fed < len(self.prompt_ids):
                if self.fed in self.pauses and self.prefix is not None:  # its blocks and its state here
                    self.prefix.insert(self.prompt_ids[: self.fed], self.cache, self.cache.n_pos)
                return []
            if self.prefix is not None and self.prior is None:  # the prompt is in: others may start from it
                self.prefix.insert(self.prompt_ids, self.cache, self.cache.n_pos)
        elif self.cache.state and self.prefix is not None and self.prior is None and self.cache.n_pos % BLOCK == 0:
            self.keep_state()
        tok = self.sampler(logits)
        self.generated.append(tok)
        self.n_gen += 1
        self.last = tok
        if self.t_first is None:
            self.t_first, self.c_first = time.perf_counter(), compile_seconds()
        if tok in self.eos:
            self.finish = "stop"
            return [Event("token", tok)]
        delta, hit = self.text.push(tok) if self.text else ("", False)
        if hit:
            self.finish = "stop"
        elif self.n_gen >= self.params.max_tokens or self.cache.n_pos >= self.cache.n_ctx:
            self.finish = "length"
        return [Event("token", tok, delta)]

    def keep_state(self) -> None:
        """A hybrid decoding: its state at this block boundary, kept (in one buffer) until
        the request ends, when it goes to the prefix cache with the blocks. The state after
        the last token cannot be cut back to a boundary, and a chat client that resends the
        conversation (the gateway's) would otherwise compute the whole reply again."""
        if self.kept is None:
            self.kept = (0, {k: np.empty_like(a) for k, a in self.cache.state.items()})
        for k, a in self.cache.state.items():
            np.copyto(self.kept[1][k], a)
        self.kept = (self.cache.n_pos, self.kept[1])

    def conversation(self) -> Conversation | None:
        """The conversation after this request (None before its first token): every token
        fed so far, with their cache, and the last one sampled."""
        if not self.generated:
            return None
        in_cache = (self.prior.tokens[:-1] if self.prior is not None else []) + self.prompt_ids + self.generated[:-1]
        assert len(in_cache) == self.cache.n_pos
        return Conversation(in_cache + self.generated[-1:], self.cache.snapshot())

    def done_event(self, model) -> Event:
        self.t_end = time.perf_counter()
        self.close(model)
        n_prompt, n_decode = len(self.prompt_ids), max(self.n_gen - 1, 0)
        c_end = compile_seconds()
        c_first = self.c_first if self.t_first else c_end
        prefill_s = (self.t_first or self.t_end) - self.t_start - (c_first - self.c_start)
        decode_s = self.t_end - (self.t_first or self.t_end) - (c_end - c_first)
        return Event(
            "done",
            text=self.text.flush() if self.text else "",
            finish_reason=self.finish,
            conversation=self.conversation() if self.keep and self.finish != "cancelled" else None,
            stats={
                "n_prompt_tokens": n_prompt,
                "cached_prompt_tokens": self.cached,
                "n_generated_tokens": self.n_gen,
                "prefill_s": round(prefill_s, 6),
                "prefill_tok_s": round((n_prompt - self.cached) / prefill_s, 3) if prefill_s > 0 else None,
                "decode_s": round(decode_s, 6),
                "decode_tok_s": round(n_decode / decode_s, 3) if decode_s > 0 and n_decode else None,
                "compile_s": round(c_end - self.c_start, 3),  # kernels compiled at first use: left out of the above
                "experts": expert_stats(model.experts.stats.minus(self.stats0), n_prompt + n_decode,
                                        prefill_s + decode_s),
            },
        )


class Batcher:
    """Continuous batching: every active request advances one step per forward (new ones
    with their prompt, the others with one token), so the step reads each weight and each
    expert of the union once for all of them. A request's tokens are the same as alone:
    every row of the batch is computed on its own.

    Chunked prefill: while requests are decoding, a step takes at most `prefill_chunk`
    prompt tokens (the oldest prompts first), so a long prompt arriving does not stop the
    running streams for its whole prefill, only for a chunk's time at each step; with
    nothing decoding, a prompt goes in one step (chunks would only read the experts again).
    `prefill_chunk` "auto" sizes the chunk from the steps' measured times (ChunkSizer).
    A prompt computed in chunks gives the same rows as in one step (the kernels' rows do
    not depend on what shares the step; tested)."""

    def __init__(self, model, prefill_chunk: int | str | None = None, prefix=None):
        # prefix: an engine.prefix.PrefixCache that requests start from and add to, or None
        self.model = model
        self.prefix = prefix
        self.active: list[Request] = []
        self.sizer: ChunkSizer | None = None
        self.set_prefill_chunk(prefill_chunk)
        # decode-only steps and their time: steps / seconds is the tok/s each running stream
        # gets (what `colictl plan` predicts for one)
        self.decode_steps, self.decode_s = 0, 0.0

    def set_prefill_chunk(self, value: int | str | None) -> None:
        """Tokens of prompt a step takes beside decoding requests: a number, "auto", or None
        or 0 (prompts whole)."""
        if value == "auto":
            self.sizer = self.sizer or ChunkSizer()
            self.prefill_chunk = None
        else:
            self.sizer, self.prefill_chunk = None, value or None

    def add(self, req: Request) -> None:
        req.t_start, req.c_start = time.perf_counter(), compile_seconds()
        req.stats0 = self.model.experts.stats.copy()
        if self.prefix is not None:
            req.use_prefix(self.prefix)
        self.active.append(req)

    def abort(self) -> list[Request]:
        """Every active request leaves without its done event (a step failed); returns them."""
        gone, self.active = self.active, []
        for r in gone:
            if r.prefix is not None:  # (what a failed step computed is not kept)
                r.prefix.release(r.held)
            r.prefix, r.held = None, []
        return gone

    def step(self) -> list[tuple[Request, Event]]:
        """One forward over all active requests; returns (request, event) pairs, a request's
        "done" event last. Cancelled requests leave without a step."""
        out = []
        for r in [r for r in self.active if r.cancelled]:
            r.finish = r.finish or "cancelled"
            out.append((r, r.done_event(self.model)))
        self.active = [r for r in self.active if not r.done]
        if not self.active:
            return out
        feeds = self.feeds()
        stepping = [r for r in self.active if feeds[id(r)]]
        t0, c0 = time.perf_counter(), compile_seconds()
        decode_only = not any(r.prefilling for r in stepping)
        logits = self.model.forward_batch([(np.asarray(feeds[id(r)]), r.cache) for r in stepping])
        step_s = time.perf_counter() - t0 - (compile_seconds() - c0)  # (a kernel compiled at first use: not the step's)
        if decode_only:
            self.decode_steps += 1
            self.decode_s += step_s
        if self.sizer is not None:
            self.sizer.observe(step_s, sum(len(feeds[id(r)]) for r in stepping if r.prefilling),
                               sum(not r.prefilling for r in stepping))
        for r, lg in zip(stepping, logits):
            out += [(r, ev) for ev in r.advance(lg[-1], len(feeds[id(r)]))]
            if r.done:
                out.append((r, r.done_event(self.model)))
        self.active = [r for r in self.active if not r.done]
        return out

    def feeds(self) -> dict[int, list[int]]:
        """id(request) -> its tokens in this step: one for each decoding request; prompt
        tokens up to the step's prefill budget (prefill_chunk while some request decodes,
        else no limit) to the prompts in arrival order; a prompt beyond the budget waits."""
        decoding = any(not r.prefilling for r in self.active)
        chunk = self.sizer.chunk if self.sizer is not None else self.prefill_chunk
        left = chunk if decoding and chunk else None
        out = {}
        for r in self.active:
            out[id(r)] = r.feed(left)
            if r.prefilling and left is not None:
                left -= len(out[id(r)])
        return out


class ChunkSizer:
    """`prefill_chunk: auto`: the prompt tokens a step takes beside decoding requests, sized
    so that such a step lasts at most GAP times a step of the decoding requests alone (their
    tokens come at most GAP times slower while a prompt goes in). It measures a decode-only
    step's time and each chunk size's step time beside decoding (running averages; a step
    over the target is believed at once), and takes the largest chunk, at most twice the
    last, whose step is predicted within AIM x GAP: a measured size by its own time, a
    larger one from the largest measured below it, per token. A size is tried only when its
    prediction fits, so steps are not sent over the target to find it (a first version
    doubled and halved around it: every few steps went to 3-8x).

    Step time is not linear in the chunk: one prompt token beside decoding takes the decode
    kernels (a sequence with one token in the step), two or more the prompt path, which
    costs several times as much a token at a few tokens (int4 rows widened to float32); a streamed model reads a chunk's union of experts, which grows fast with the
    first tokens and then slowly. So from one measured token the prediction for more takes
    the prompt path's price, and beyond that each size's own measure. Timing moves only
    the chunk size, never a token. The price is the prompt's own speed: where one prompt
    token beside the decode rows already costs a good part of a decode step, the chunk
    stays at one token and the prompt takes several times longer than whole
    (docs/benchmarks.md); a fixed prefill_chunk trades the other way."""

    GAP = 2.0
    AIM = 0.85  # of GAP: what a chunk is sized for
    PROMPT_PATH = 4.0  # a prompt-path token's cost against one on the decode kernels at a few tokens (5.6x
    # measured on the int4 bench model in RAM: two tokens widen each of their experts to float32)
    START, SMALLEST, LARGEST = 1, 1, 1024
    EMA = 0.2  # weight of the newest step in the running averages

    def __init__(self):
        self.chunk = self.START
        self.decode_s: float | None = None  # a decode-only step's time, running average
        self.cost: dict[int, float] = {}  # chunk size -> its step's time beside decoding, running average

    def observe(self, step_s: float, prompt_tokens: int, decoding: int) -> None:
        """A step took step_s with prompt_tokens of prompt beside `decoding` requests."""
        if not decoding:
            return
        if not prompt_tokens:
            self.decode_s = step_s if self.decode_s is None else (1 - self.EMA) * self.decode_s + self.EMA * step_s
            return
        if self.decode_s is None:
            return
        old = self.cost.get(prompt_tokens)
        if old is None or step_s > self.GAP * self.decode_s:
            self.cost[prompt_tokens] = max(step_s, old or 0.0)  # over the target: believed at once
        else:
            self.cost[prompt_tokens] = (1 - self.EMA) * old + self.EMA * step_s
        fits = [n for n in range(1, min(self.LARGEST, 2 * self.chunk) + 1)
                if self.predict(n) <= self.AIM * self.GAP * self.decode_s]
        self.chunk = max(fits, default=self.SMALLEST)

    def predict(self, n: int) -> float:
        """A step's time with n prompt tokens beside the decoding requests."""
        if n in self.cost:
            return self.cost[n]
        m = max((k for k in self.cost if k < n), default=0)
        if m == 0:
            return self.decode_s
        per = max(self.cost[m] - self.decode_s, 0.0) / m
        if m == 1:  # (one token took the decode kernels; more take the prompt path)
            return self.decode_s + n * per * self.PROMPT_PATH
        return self.cost[m] + (n - m) * per


def generate(model, prompt_ids, params: SamplingParams, eos_ids=(), tokenizer=None, prior: Conversation | None = None,
             keep: bool = False) -> Iterator[Event]:
    """Generate from prompt_ids, yielding a "token" event per new token and one "done"
    (continuing `prior`; with `keep`, the done event carries the conversation after it).

    Raises InvalidRequest (bad parameters, empty prompt, a prior that does not fit) or
    PromptTooLong before any work.
    """
    batcher = Batcher(model)
    batcher.add(Request(model, prompt_ids, params, eos_ids, tokenizer, prior=prior, keep=keep))
    while batcher.active:
        for _, ev in batcher.step():
            yield ev
