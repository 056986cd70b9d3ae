"""The expert cache: routed experts streamed from a container into RAM slots under a
byte budget.

- One arena (arena.py) per budget, cut into record-sized slots. Nothing is allocated
  per read. Who holds each slot, and how the policy splits them (a pinned part, LRU
  shares or windows, `learned`'s main region), is slots.py (SlotBook); what the cache
  reports is cache_report.py (CacheReport). This file is the streaming path.
- Every step's routing goes into the usage history (history.py); every
  `repin_every` steps the learned hot set is revised between steps (memory copies of
  experts already resident, no reads).
- `stream(il, ids)` serves one layer's step: the union of the experts its tokens chose
  (batch-union: each read once). Misses are read by the reader (reader.py: O_DIRECT,
  checksums, retry, other drives) on its small thread pool, started before the resident experts are handed out, so the engine
  computes the hits while the misses land (the kernels release the GIL). A slot
  used in this step is not reused until the engine has computed with it, which is
  why one slot per layer is enough: a layer's experts then stream through it.
"""

import logging
import time
from collections import OrderedDict, deque
from collections.abc import Iterator
from concurrent.futures import Future

import numpy as np

from .arena import Arena
from .cache_report import CacheReport
from .container import Container
from .errors import ExpertReadError
from .experts import ExpertStats, LocalSource
from .faults import FaultPlan
from .history import UsageHistory
from .memory import MemoryRoom
from .policy import Policy
from .reader import ExpertReader
from .slots import SlotBook, budget_bytes, min_budget_bytes  # noqa: F401 (budgets are asked of the cache too)

log = logging.getLogger("colibri.storage")


class ExpertCache(SlotBook, CacheReport, LocalSource):
    """Experts of `container` under `budget` bytes (or "min"/"all").

    Raises BudgetInvalid when the budget cannot hold one slot per MoE layer (the message
    says the minimum), OSError when the expert files cannot be opened.
    """

    def __init__(self, container: Container, budget: int | str, io_threads: int = 2, direct: bool = True,
                 mlock: bool = False, hugetlb: bool = False, top_k: int = 1, policy: Policy | None = None,
                 history: UsageHistory | None = None, verify: str = "first", drives: list[str] | None = None,
                 faults: FaultPlan | None = None, coalesce: bool = True, reader: str = "preadv",
                 queue_depth: int = 32, sqpoll_cpu: int | None = None, room: MemoryRoom | None = None,
                 beside: int = 0):
        self.c = container
        # the RAM budgets may take (None: unchecked), and what the daemon's other budgets
        # (the prefix cache) take of it: a budget above the rest is refused
        self.room, self.beside = room, beside
        self.record_bytes = container.record_bytes
        self.mlock_asked, self.hugetlb_asked = mlock, hugetlb
        self.top_k = top_k  # experts per token: the LRU part keeps this many slots per layer when pinning
        self.policy = (policy or Policy(name="lru")).check()
        self.history = history or UsageHistory(container.moe_layers, container.n_expert)
        self._arena: Arena | None = None
        self.lru: dict[int, OrderedDict[int, int]] = {il: OrderedDict() for il in container.moe_layers}  # ie -> slot
        self.by_layer = {il: [0, 0, 0] for il in container.moe_layers}  # hits, misses, bytes read (stats)
        self.pinned: dict[tuple[int, int], int] = {}  # (il, ie) -> slot, by hand (pin) or by policy
        self.hand_pins: set[tuple[int, int]] = set()  # pinned by hand: never repinned away
        self.pinned_set_by_hand = False  # False: the pinned part's size follows the policy
        self.prefetched: dict[int, dict[int, tuple]] = {}  # il -> {ie: (slot, read future)} not yet streamed
        self.unchosen: dict[int, list[tuple]] = {}  # il -> [(ie, slot, read future)]: predicted, not chosen, in flight
        self.row = {il: i for i, il in enumerate(container.moe_layers)}  # layer -> its row in the history
        self.main: dict[tuple[int, int], int] = {}  # `learned`: (il, ie) -> slot, kept by usage
        self.arranged = None  # arrange(): how the engine lays the experts out in RAM (None: as the records)
        self._place(budget)
        self.stats = ExpertStats()
        self.reader = ExpertReader(container, self.stats, io_threads, direct, verify, drives, faults, coalesce, reader,
                                   queue_depth, sqpoll_cpu)

    def begin_step(self) -> None:
        self.stats.steps += 1
        self.history.step()
        p = self.policy
        if p.learns and p.repin_every and self.stats.steps % p.repin_every == 0:
            self.repin()

    def warm_start(self, progress=None) -> int:
        """Read in what the usage history says is hot (several reads at a time): for
        `lru+pinned` the hot set into the free pinned slots, for `learned` the hottest experts
        into the free slots of the main region. The start from what the box learned before.
        `progress(phase, done, total)` hears each read land. Returns the experts read.
        Raises ExpertReadError."""
        reads = []
        if self.policy.learns:
            want = [k for k in self.history.hottest(len(self.pinned) + len(self.pin_free)) if k not in self.pinned]
            for key in want[: len(self.pin_free)]:
                il, ie = key
                slot = self.pin_free.popleft()
                self.pinned[key] = slot
                if ie in self.lru[il]:
                    src = self._unkeep(il, ie)
                    self.arena[slot] = self.arena[src]
                    self._release(il, src)
                else:
                    reads.append((key, slot, True))
        elif self.main_free:
            resident = sum(map(len, self.lru.values())) + len(self.main)
            want = [k for k in self.history.hottest(len(self.main_free) + resident)
                    if k not in self.main and k[1] not in self.lru[k[0]]][: len(self.main_free)]
            for key in want:
                reads.append((key, self.main_free.popleft(), False))
        futures = [(key, slot, pin, self._submit(key, slot)) for key, slot, pin in reads]
        failed = None
        for i, (key, slot, pin, fut) in enumerate(futures):
            if progress:
                progress("warming the expert cache", i, len(futures))
            try:
                fut.result()
            except ExpertReadError as e:
                failed = e
                if pin:
                    del self.pinned[key]
                    self.pin_free.append(slot)
                else:
                    self.main_free.append(slot)
                continue
            self.stats.bytes_read += self.c.records[key].length
            self._arrive(slot)
            if not pin:
                self._admit(key, slot)
        if failed:
            raise failed
        return len(futures)

    def close(self) -> None:
        self.reader.close()

    def arrange(self, fn) -> None:
        """Lay the experts' bytes out for the engine's kernels: every slot's now, and each
        record's as its read lands from here on (when it is waited for, after its checksum).
        fn(expert weights, on) rearranges one expert in place, to the kernels' layout (on) or
        back to the records' (off); None: the records' layout again. The engine's choice
        (MoEModel.set_activations: int8 activations compute on tiles of rows); the files, the
        reads and their checksums keep the records as written. (On the I/O threads instead, the
        25 % memory-limit decode ran 18.5 against 22.3 tok/s: a thread laying an expert out
        issues no read, and the drive is the bottleneck there.)"""
        if fn is self.arranged:
            return
        self.settle_prefetch()  # (no read is in flight while every slot is rearranged)
        for slot in range(len(self.arena)):  # (a free slot's bytes too: harmless, overwritten by its next read)
            if self.arranged is not None:
                self.arranged(self.views(slot), False)
            if fn is not None:
                fn(self.views(slot), True)
        self.arranged = fn

    def _arrive(self, slot: int) -> None:
        if self.arranged is not None:
            self.arranged(self.views(slot), True)

    def views(self, slot: int, key: tuple[int, int] | None = None) -> tuple:
        # a slot's expert's weights, kept while the slot holds it (a container's records share
        # one layout: the same views whichever expert a slot holds; a GGUF file's experts each
        # have their own)
        key = key if self.c.views_per_record else None
        v = self._views.get(slot)
        if v is None or v[0] != key:
            v = self._views[slot] = (key, self.c.expert_views(self.arena[slot], key))
        return v[1]

    def _int4_table(self, arena: np.ndarray) -> tuple | None:
        """(group size, the layouts of gate, up and down, [slots, 6] int64: where each slot's
        int4 matrices start: gate q, scales, up q, scales, down q, scales) when the experts are
        int4 without biases; else None. Every record has the container's one layout, so a
        slot's addresses are its start plus the same six offsets."""
        if self.c.expert_dtype != "int4" or not len(arena):
            return None
        ew = self.c.expert_views(arena[0])
        if len(ew) != 3 or ew.int4 is None:
            return None
        g, layouts, addrs = ew.int4
        offsets = np.frombuffer(addrs, np.int64) - arena.ctypes.data
        starts = arena.ctypes.data + np.arange(len(arena), dtype=np.int64) * arena.strides[0]
        return g, layouts, starts[:, None] + offsets[None, :]

    def int4_hits(self, il: int, ids: list[int]) -> tuple | None:
        """Layer il's step of experts `ids` (unique) when every one is resident and the
        experts are int4: (group size, layouts, [len(ids), 6] int64 addresses of their
        matrices in `ids` order, as Crew.experts_at takes them; valid until the next call into
        the cache), the step counted exactly as stream() counts a step of hits. None, with
        nothing counted, when one is not resident or reads started ahead for this layer are
        pending: stream() serves the step then. A warm decode step's way past a view per
        expert (engine/moe.moe): in the decode the Python around the kernels ran from
        memory the weights had just pushed out of the caches, a miss per object touched."""
        table = self.int4_slots
        if table is None or self.prefetched.get(il):
            return None
        self._settle_unchosen(il)
        lru, pinned, main = self.lru[il], self.pinned, self.main
        slots = []
        for ie in ids:
            slot = lru.get(ie)
            if slot is None and (slot := pinned.get(key := (il, ie))) is None and (slot := main.get(key)) is None:
                return None
            slots.append(slot)
        self.prefetched.pop(il, None)
        self.history.record(il, ids)
        st = self.stats
        st.fetches += 1
        st.experts += len(ids)
        st.hits += len(ids)
        self.by_layer[il][0] += len(ids)
        for ie in ids:
            if ie in lru:
                lru.move_to_end(ie)
        if self.main_slots:
            self._trim_window(il)
        return table[0], table[1], table[2][slots]

    def _submit(self, key: tuple[int, int], slot: int) -> Future:
        return self.reader.submit(key, self.arena[slot])

    def stream(self, il: int, ids: list[int]) -> Iterator[list[tuple[int, tuple]]]:
        """Batches of (expert id, (gate, up, down)) covering `ids` (unique) of layer il: the
        hits first, then the misses as their reads complete (each batch: every read done by
        then). A batch's weights are valid until the next batch is asked for.
        Raises ExpertReadError."""
        st, lru = self.stats, self.lru[il]
        self.history.record(il, ids)
        st.fetches += 1
        st.experts += len(ids)
        self._settle_unchosen(il)
        ahead = self.prefetched.pop(il, {})  # reads started by prefetch() for this layer
        for ie in [ie for ie in ahead if ie not in ids]:  # predicted but not chosen: kept once landed, not waited for
            slot, fut = ahead.pop(ie)
            self.unchosen.setdefault(il, []).append((ie, slot, fut))
            st.bytes_read += (n := self.c.records[(il, ie)].length)  # (a GGUF expert's: less than its slot)
            self.by_layer[il][2] += n
            st.prefetch_wasted += 1
        hits, pinned, pending = [], [], deque()  # in the layer's LRU; pinned or main (slots that stay put); to read
        for ie in ids:
            if ie in lru:
                hits.append(ie)
            elif (slot := self.pinned.get(key := (il, ie))) is not None or (slot := self.main.get(key)) is not None:
                pinned.append((ie, slot))
            elif ie not in ahead:
                pending.append(ie)
        records = self.c.records
        pending = deque(sorted(pending, key=lambda ie: (records[(il, ie)].file, records[(il, ie)].offset)))
        st.hits += len(hits) + len(pinned)
        st.misses += len(pending) + len(ahead)
        counts = self.by_layer[il]
        counts[0] += len(hits) + len(pinned)
        counts[1] += len(pending) + len(ahead)
        st.prefetch_used += len(ahead)
        busy = set(hits) | set(ahead) | {ie for ie, _ in pinned}  # experts of this step whose slots must not be reused yet
        inflight: deque[tuple[int, int, Future]] = deque((ie, slot, fut) for ie, (slot, fut) in ahead.items())

        def submit():
            # misses in file order, as many as slots allow
            while pending:
                picks = []
                while pending and (slot := self._take_slot(il, busy, pending[0])) is not None:
                    ie = pending.popleft()
                    busy.add(ie)
                    picks.append((ie, slot))
                inflight.extend(self._read_in_runs(il, picks))
                if not pending or not self.unchosen.get(il):
                    return
                self._settle(il, *self.unchosen[il].pop(0))  # every slot taken: one a wasted read holds comes back

        def landed(ie, slot, fut):
            t0 = time.perf_counter()
            try:
                fut.result()
            except ExpertReadError:
                self._release(il, slot)
                raise
            finally:
                st.io_wait_s += time.perf_counter() - t0
            st.bytes_read += (n := self.c.records[(il, ie)].length)  # (a GGUF expert's: less than its slot)
            self.by_layer[il][2] += n
            self._arrive(slot)
            self._keep(il, ie, slot)
            return ie, self.views(slot, (il, ie))

        try:
            submit()
            if hits or pinned:
                for ie in hits:
                    lru.move_to_end(ie)
                views = self.views
                yield [(ie, views(lru[ie], (il, ie))) for ie in hits] + [(ie, views(slot, (il, ie))) for ie, slot in pinned]
                busy.difference_update(hits)
                busy.difference_update(ie for ie, _ in pinned)
                submit()
            while inflight:
                batch = [landed(*inflight.popleft())]  # the oldest read, waited for
                while inflight and inflight[0][2].done():  # and every read already done
                    batch.append(landed(*inflight.popleft()))
                yield batch
                busy.difference_update(ie for ie, _ in batch)
                submit()
        finally:
            for ie, slot, fut in inflight:  # abandoned (an error or the consumer stopped): settle the reads
                self._settle(il, ie, slot, fut)
            if self.main_slots:
                self._trim_window(il)

    def _read_in_runs(self, il: int, picks: list[tuple[int, int]]) -> list[tuple[int, int, Future]]:
        """Start reading experts of layer il into their slots, picks [(expert, slot)] in file
        order: a run of records adjacent in their file goes as one read (up to the reader's
        max_run). Returns [(expert, slot, future)]."""
        out, run = [], []
        for k, (ie, slot) in enumerate(picks):
            run.append((ie, slot))
            if (k + 1 == len(picks) or len(run) == self.reader.max_run
                    or not self.reader.adjacent((il, ie), (il, picks[k + 1][0]))):
                futures = self.reader.submit_run([((il, j), self.arena[s]) for j, s in run])
                out.extend((j, s, fut) for (j, s), fut in zip(run, futures))
                run = []
        return out

    def _settle(self, il: int, ie: int, slot: int, fut: Future) -> None:
        """A read started ahead has landed (or is waited for): its expert is resident."""
        try:
            fut.result()
            self._arrive(slot)
            self._keep(il, ie, slot)
        except ExpertReadError:
            self._release(il, slot)

    def _settle_unchosen(self, il: int) -> None:
        """Layer il's predicted-but-not-chosen reads of earlier steps, kept as resident
        (long landed by the time the layer comes round again)."""
        for ie, slot, fut in self.unchosen.pop(il, ()):
            self._settle(il, ie, slot, fut)

    def settle_prefetch(self) -> None:
        """Wait for reads started ahead and keep what they read as resident."""
        for il, ahead in self.prefetched.items():
            for ie, (slot, fut) in ahead.items():
                self._settle(il, ie, slot, fut)
        self.prefetched = {}
        for il in list(self.unchosen):
            self._settle_unchosen(il)

    @property
    def int4_group(self) -> int | None:
        return self.c.group_size if self.c.expert_dtype == "int4" else None

    @property
    def lookahead(self) -> bool:
        # not once every expert is resident (a budget that holds the whole model, warm): the
        # prediction would be a router and a norm a layer for reads that cannot happen
        if self.policy.prefetch_reads <= 0:
            return False
        resident = len(self.pinned) + len(self.main) + sum(len(lru) for lru in self.lru.values())
        return resident < len(self.c.records)

    def layer_done(self, il: int, routed: int, moe_s: float) -> None:
        self.stats.routed += routed
        self.stats.moe_s += moe_s

    def prefetch(self, il: int, ids: list[int], tokens: int = 1, max_reads: int | None = None) -> int:
        """Start reading experts `ids` of layer il that are not resident, predicted from a
        step of `tokens` tokens, at most `max_reads`, into that layer's free or least
        recently used slots; stream() picks them up, and leaves the reads of experts it was
        not asked for to land in the background (kept at the layer's next step). The
        prediction only moves data: stream() still serves exactly what it is asked for.
        Call between the layers of a step. `max_reads` None: the policy's prefetch_reads for
        each token. A prompt's union is read ahead whole so that the disk keeps reading
        while the step's attention and dense work run: a 512-token bf16 prompt at a 10 %
        budget waited 1.0-1.7 s for reads with 8 ahead, 0.2-0.3 s with its union.
        Returns the reads started."""
        max_reads = self.policy.prefetch_reads * max(1, tokens) if max_reads is None else max_reads
        self._settle_unchosen(il)
        lru, ahead = self.lru[il], self.prefetched.setdefault(il, {})
        protect = set(ids) | set(ahead)  # a predicted expert that is resident must not make room for another
        picks = []  # (expert, slot) to read
        for ie in ids:
            if len(picks) >= max_reads:
                break
            if ie in lru or (il, ie) in self.pinned or (il, ie) in self.main or ie in ahead:
                continue
            slot = self._take_slot(il, protect, ie, ahead=True)
            if slot is None:
                break
            picks.append((ie, slot))
        records = self.c.records
        picks.sort(key=lambda p: (records[(il, p[0])].file, records[(il, p[0])].offset))
        ahead.update((ie, (slot, fut)) for ie, slot, fut in self._read_in_runs(il, picks))
        self.stats.prefetch_issued += len(picks)
        return len(picks)
