"""The expert cache: routed experts streamed from a container into RAM slots under a
byte budget.

- One arena (arena.py) per budget, cut into record-sized slots. Nothing is allocated
  per read.
- The slots are split as the policy says (policy.py): a pinned part (hand pins, and
  `lru+pinned`'s learned hot set) holds experts of any layer that are never evicted;
  for `lru` and `lru+pinned` each MoE layer owns an equal share of the rest and keeps
  it as an LRU; for `learned` each layer keeps a small LRU window and the rest is one
  main region for all layers, kept by usage (an admission moves no bytes: slots change
  owner).
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

from .arena import Arena, allocate
from .container import Container
from .errors import BudgetInvalid, ExpertReadError
from .experts import ExpertStats, LocalSource
from .faults import FaultPlan
from .history import UsageHistory
from .memory import MemoryRoom
from .policy import Policy, learned_slots, plan_repin, victim
from .reader import ExpertReader
from .sizes import fmt_bytes

log = logging.getLogger("colibri.storage")


def min_budget_bytes(n_moe_layers: int, record_bytes: int) -> int:
    """The smallest expert budget that runs: one slot per MoE layer, through which the
    layer's experts stream (the daemon refuses less; plan and tune never recommend less)."""
    return n_moe_layers * record_bytes


def budget_bytes(budget: int | str, n_moe_layers: int, n_expert: int, record_bytes: int,
                 room: MemoryRoom | None = None, beside: int = 0) -> int:
    """An expert budget (bytes, "min" or "all") in bytes, checked as placing a model and
    resizing its cache check it: within `room` (None: unchecked) beside `beside` bytes of
    the prefix cache, and not below the minimum. Raises BudgetInvalid saying which."""
    least = min_budget_bytes(n_moe_layers, record_bytes)
    what = "every expert (expert_cache all)" if budget == "all" else "an expert cache"
    n = least if budget == "min" else n_moe_layers * n_expert * record_bytes if budget == "all" else int(budget)
    if room is not None:
        room.check(what, n, beside, "the prefix cache")
    if n < least:
        raise BudgetInvalid(
            f"expert cache of {fmt_bytes(n)} is too small: the minimum is {fmt_bytes(least)} "
            f"({least} bytes: one {fmt_bytes(record_bytes)} expert slot for each of {n_moe_layers} MoE layers)")
    return n


class ExpertCache(LocalSource):
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
        self._place(budget)
        self.stats = ExpertStats()
        self.reader = ExpertReader(container, self.stats, io_threads, direct, verify, drives, faults, coalesce, reader,
                                   queue_depth, sqpoll_cpu)

    def slots_for(self, budget: int | str) -> tuple[int, int]:
        """(slots per MoE layer, bytes asked) for a budget. Raises BudgetInvalid below the
        minimum, or above the RAM the box has for it (`room`)."""
        rb, n_moe, n_expert = self.record_bytes, len(self.c.moe_layers), self.c.n_expert
        total = budget_bytes(budget, n_moe, n_expert, rb, self.room, self.beside)
        return min(total // rb // n_moe, n_expert), total

    def _place(self, budget: int | str, pinned_bytes: int | None = None) -> None:
        """Make the arena for `budget`, of which `pinned_bytes` (None: what the policy's
        hot set takes) hold pinned experts (never evicted) and the rest the per-layer LRU
        shares, and move into it the hand pins, the hottest learned pins and the most
        recently used experts that fit. Call between steps, never during a stream.
        Raises BudgetInvalid when pins would leave the LRU part fewer than top_k slots per
        layer (one token's experts), or when the budget is below one slot per layer."""
        rb, layers = self.record_bytes, self.c.moe_layers
        total = self.slots_for(budget)[1]  # raises below the minimum
        self.settle_prefetch()
        if pinned_bytes is None:
            n_pin = max(learned_slots(self.policy, total // rb, len(layers), self.top_k, self.c.n_expert), len(self.hand_pins))
        else:
            n_pin = min(pinned_bytes // rb, len(layers) * self.c.n_expert)
        if n_pin and total - n_pin * rb < len(layers) * self.top_k * rb:
            most = max(total - len(layers) * self.top_k * rb, 0)
            raise BudgetInvalid(
                f"pinning {fmt_bytes(n_pin * rb)} of a {fmt_bytes(total)} budget leaves the LRU fewer than "
                f"{self.top_k} slot(s) of {fmt_bytes(rb)} per MoE layer (one token's experts); the pinned part "
                f"can be at most {fmt_bytes(most)} ({most} bytes)"
                + ("" if pinned_bytes is None else
                   ": give a smaller pinned part with the budget (cache set --pinned SIZE, or --pinned auto)")
            )
        per_layer, _ = self.slots_for(total - n_pin * rb)
        budget_bytes = int(total)
        n_lru = per_layer * len(layers)
        n_slots = n_lru + n_pin
        new = allocate(n_slots, rb, self.hugetlb_asked, self.mlock_asked)
        arena = new.slots  # [slots, record_bytes]
        n_main = 0
        if self.policy.windowed:  # a recency window per layer, the rest one region kept by usage
            window = max(1, min(self.top_k, per_layer, per_layer // 4))
            n_main, per_layer = n_lru - window * len(layers), window
        free, lru, main = {}, {}, {}
        slot_row, slot_ie = np.full(n_slots, -1, np.int64), np.zeros(n_slots, np.int64)  # who holds a slot
        slot_main = np.zeros(n_slots, bool)
        spill = []  # residents that do not fit their window: candidates for the main region
        for i, il in enumerate(layers):
            slots = deque(range(i * per_layer, (i + 1) * per_layer))
            old = list(self.lru[il].items())
            keep = old[-per_layer:]  # the most recent that fit
            spill += [((il, ie), s) for ie, s in old[: len(old) - len(keep)]]
            lru[il] = OrderedDict()
            for ie, old_slot in keep:
                slot = slots.popleft()
                arena[slot] = self.arena[old_slot]
                lru[il][ie] = slot
                slot_row[slot], slot_ie[slot] = i, ie
            free[il] = slots
        self._learn(n_slots)
        main_free = deque(range(per_layer * len(layers), per_layer * len(layers) + n_main))
        spill += list(self.main.items())
        for key, old_slot in sorted(spill, key=lambda kv: -self.history.worth(kv[0]))[:n_main]:  # the most worth
            slot = main_free.popleft()
            arena[slot] = self.arena[old_slot]
            main[key] = slot
            slot_row[slot], slot_ie[slot], slot_main[slot] = self.row[key[0]], key[1], True
        pin_slots, pinned = deque(range(n_lru, n_slots)), {}
        keep = sorted(self.pinned.items(), key=lambda kv: (kv[0] not in self.hand_pins, -self.history.value(kv[0])))
        self.hand_pins &= {k for k, _ in keep[:n_pin]}
        for key, old_slot in keep[:n_pin]:  # hand pins first, then the hottest learned ones
            slot = pin_slots.popleft()
            arena[slot] = self.arena[old_slot]
            pinned[key] = slot
        old = self._arena
        self._arena, self.arena, self.free, self.lru, self._views = new, arena, free, lru, {}
        self.slot_row, self.slot_ie, self.slot_main = slot_row, slot_ie, slot_main
        self.main, self.main_free, self.main_slots = main, main_free, n_main
        self.pinned, self.pin_free, self.pinned_bytes = pinned, pin_slots, n_pin * rb
        self.n_slots, self.slots_per_layer = n_slots, per_layer
        self.budget_bytes, self.arena_bytes = budget_bytes, n_slots * rb
        self.int4_slots = self._int4_table(arena)
        if old is not None:
            old.close()

    def resize(self, budget: int | str, pinned_bytes: int | str | None = None) -> dict:
        """Change the budget and its pinned part (bytes; "auto": what the policy's hot set
        takes; None: as before) at runtime, keeping the hand pins, the hottest learned pins
        and the most recently used experts that fit. Call between forward steps.
        Raises BudgetInvalid. Returns describe()."""
        by_hand = self.pinned_set_by_hand if pinned_bytes is None else pinned_bytes != "auto"
        pinned = None if not by_hand else self.pinned_bytes if pinned_bytes is None else int(pinned_bytes)
        self._place(budget, pinned)
        self.pinned_set_by_hand = by_hand
        return self.describe()

    def set_policy(self, policy: Policy) -> dict:
        """Use `policy` from the next step on (between steps). The pinned part follows it
        unless its size was set by hand. Raises BudgetInvalid. Returns describe()."""
        old, self.policy = self.policy, policy.check()
        if not self.pinned_set_by_hand:
            try:
                self._place(self.budget_bytes, None)
            except BudgetInvalid:
                self.policy = old
                raise
        if not policy.learns:  # learned pins go back to being ordinary residents
            for key in [k for k in self.pinned if k not in self.hand_pins]:
                self.pin_free.append(self.pinned.pop(key))
        self._learn(self.n_slots)
        return self.describe()

    def _learn(self, n_slots: int) -> None:
        # `learned-opt`: the history learns from Belady's optimum for a cache of this size
        self.history.learn_optimum(n_slots if self.policy.learns_optimum else None, self.top_k)

    def begin_step(self) -> None:
        self.stats.steps += 1
        self.history.step()
        p = self.policy
        if p.learns and p.repin_every and self.stats.steps % p.repin_every == 0:
            self.repin()

    def repin(self) -> int:
        """Revise the learned hot set from the usage history (policy.plan_repin): experts
        resident in the LRU part move into the pinned part, displaced learned pins go back
        to the LRU (the oldest entry of their layer) when there is room, else out. Memory
        copies only, no reads. Hand pins stay. Call between steps. Returns the moves."""
        self.settle_prefetch()
        learned = [k for k in self.pinned if k not in self.hand_pins]
        challengers = [(il, ie) for il, d in self.lru.items() for ie in d]
        moves = plan_repin(self.history.value, learned, challengers, len(self.pin_free), self.policy.repin_margin)
        for (il, ie), drop in moves:
            src = self._unkeep(il, ie)
            if drop is None:
                slot = self.pin_free.popleft()
                self.arena[slot] = self.arena[src]
                self._release(il, src)
            else:
                slot = self.pinned.pop(drop)
                if drop[0] == il:  # same layer: the two swap slots
                    held = self.arena[slot].copy()
                    self.arena[slot] = self.arena[src]
                    self.arena[src] = held
                    self._keep(il, drop[1], src, oldest=True)
                else:
                    self.arena[slot] = self.arena[src]
                    self._release(il, src)
            self.pinned[(il, ie)] = slot
        self.stats.repins += len(moves)
        return len(moves)

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
            self.stats.bytes_read += self.record_bytes
            if not pin:
                self._admit(key, slot)
        if failed:
            raise failed
        return len(futures)

    def pin(self, il: int, ie: int) -> None:
        """Keep expert ie of layer il resident until unpinned (read now if it is not).
        Call between steps. Raises BudgetInvalid (no pinned room), KeyError (no such expert),
        ExpertReadError."""
        key = (il, ie)
        rec = self.c.records[key]
        if key in self.pinned:
            self.hand_pins.add(key)
            return
        learned = [k for k in self.pinned if k not in self.hand_pins]
        if not self.pin_free and learned:  # a hand pin displaces the coldest learned one
            self.pin_free.append(self.pinned.pop(min(learned, key=self.history.value)))
        if not self.pin_free:
            raise BudgetInvalid(f"no room to pin: {len(self.pinned)} experts fill the pinned part of "
                                f"{fmt_bytes(self.pinned_bytes)}; grow it with cache set --pinned SIZE")
        slot = self.pin_free.popleft()
        if ie in self.lru[il]:  # resident already: move it out of the LRU
            old = self._unkeep(il, ie)
            self.arena[slot] = self.arena[old]
            self._release(il, old)
        elif key in self.main:  # or out of the main region
            old = self.main.pop(key)
            self.arena[slot] = self.arena[old]
            self.slot_row[old], self.slot_main[old] = -1, False
            self.main_free.append(old)
        else:
            try:
                self.reader.read(rec, self.arena[slot])
            except ExpertReadError:
                self.pin_free.appendleft(slot)
                raise
            self.stats.bytes_read += self.record_bytes
        self.pinned[key] = slot
        self.hand_pins.add(key)

    def unpin(self, il: int, ie: int) -> None:
        """Let the expert be evicted again. Raises KeyError if it is not pinned."""
        self.pin_free.append(self.pinned.pop((il, ie)))
        self.hand_pins.discard((il, ie))

    def close(self) -> None:
        self.reader.close()

    def views(self, slot: int) -> tuple:
        v = self._views.get(slot)
        if v is None:
            v = self._views[slot] = self.c.expert_views(self.arena[slot])
        return v

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

    def _keep(self, il: int, ie: int, slot: int, oldest: bool = False) -> None:
        """Expert ie of layer il is resident in LRU slot `slot` (the most recent, or the oldest)."""
        self.lru[il][ie] = slot
        if oldest:
            self.lru[il].move_to_end(ie, last=False)
        self.slot_row[slot], self.slot_ie[slot] = self.row[il], ie

    def _unkeep(self, il: int, ie: int) -> int:
        """Take expert ie of layer il out of the LRU part; returns its slot (now unowned)."""
        slot = self.lru[il].pop(ie)
        self.slot_row[slot] = -1
        return slot

    def _release(self, il: int, slot: int) -> None:
        self.slot_row[slot] = -1
        self.free[il].append(slot)

    def _take_slot(self, il: int, busy: set[int], want: int, ahead: bool = False) -> int | None:
        """A slot for a read of expert `want` of layer il: a free one of its share, else its
        LRU victim's (never one of `busy`, this step's experts of il). None when every one
        is busy.
        `learned`: the victim leaves the layer's window for the main region when the main
        region has room or when it is used more than the main region's least used expert,
        which then gives up its slot instead (no bytes move: slots change owner)."""
        if self.free[il]:
            return self.free[il].popleft()
        ie = victim(self.lru[il], busy)
        if ie is None:
            return self._borrow(il, busy, want, ahead) if self.main_slots else None
        slot = self._unkeep(il, ie)
        if self.main_slots:
            key = (il, ie)
            if self.main_free:
                self._admit(key, slot)
                return self.main_free.popleft()
            low = self._least_used_main(il, busy)
            if low is not None and self.history.worth(key) > self.history.worth(low):
                out = self.main.pop(low)
                self.slot_row[out], self.slot_main[out] = -1, False
                self._admit(key, slot)
                slot = out
        self.stats.evictions += 1
        return slot

    def _borrow(self, il: int, busy: set[int], want: int, ahead: bool = False) -> int | None:
        """`learned`, when this step's experts fill the layer's window: a slot of the main
        region (a free one, or its least used expert's if `want` is used more) so that the
        step's reads still go on in parallel; the window gives it back when the step ends
        (_trim_window). A read `ahead` (prefetch) borrows whatever the counts say: its
        expert is predicted for this step, whose use the history has not seen yet.
        None: the read waits for a window slot."""
        if self.main_free:
            return self.main_free.popleft()
        low = self._least_used_main(il, busy)
        if low is None or (not ahead and self.history.worth(low) >= self.history.worth((il, want))):
            return None
        slot = self.main.pop(low)
        self.slot_row[slot], self.slot_main[slot] = -1, False
        self.stats.evictions += 1
        return slot

    def _trim_window(self, il: int) -> None:
        """Back to the window's size after a step that borrowed: the slots go back to the
        main region, each with the window's oldest expert if that is used at least as much
        as the main region's least used one, else empty."""
        lru = self.lru[il]
        while len(lru) > self.slots_per_layer:
            ie = next(iter(lru))
            slot = self._unkeep(il, ie)
            low = self._least_used_main(il, set())
            if low is None or self.history.worth((il, ie)) >= self.history.worth(low):
                self._admit((il, ie), slot)
            else:
                self.main_free.append(slot)

    def _admit(self, key: tuple[int, int], slot: int) -> None:
        self.main[key] = slot
        self.slot_row[slot], self.slot_ie[slot], self.slot_main[slot] = self.row[key[0]], key[1], True

    def _least_used_main(self, il: int, busy: set[int]) -> tuple[int, int] | None:
        """The main region's expert worth least (history.worth), not one of layer il's `busy`."""
        vals = np.where(self.slot_main, self.history.worths(self.slot_row, self.slot_ie), np.inf)
        for ie in busy:
            if (il, ie) in self.main:
                vals[self.main[(il, ie)]] = np.inf
        slot = int(np.argmin(vals))
        if not np.isfinite(vals[slot]):
            return None
        return self.c.moe_layers[self.slot_row[slot]], int(self.slot_ie[slot])

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
            st.bytes_read += self.record_bytes
            self.by_layer[il][2] += self.record_bytes
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
            st.bytes_read += self.record_bytes
            self.by_layer[il][2] += self.record_bytes
            self._keep(il, ie, slot)
            return ie, self.views(slot)

        try:
            submit()
            if hits or pinned:
                for ie in hits:
                    lru.move_to_end(ie)
                views = self.views
                yield [(ie, views(lru[ie])) for ie in hits] + [(ie, views(slot)) for ie, slot in pinned]
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

    def expert_map(self) -> dict:
        """Where each expert is now and how hot: {"where": a string per MoE layer, one
        letter per expert (p pinned, c cached, d on disk only), "heat": per layer the usage
        history's decayed counts over the hottest's, rounded}. For the live map."""
        values = self.history.values()
        top = float(values.max()) or 1.0
        where = []
        for il in self.c.moe_layers:
            row = ["d"] * self.c.n_expert
            for ie in self.lru[il]:
                row[ie] = "c"
            for (jl, ie) in self.main:
                if jl == il:
                    row[ie] = "c"
            for (jl, ie) in self.pinned:
                if jl == il:
                    row[ie] = "p"
            where.append("".join(row))
        return {"where": where, "heat": [[round(float(v) / top, 3) for v in values[self.row[il]]]
                                         for il in self.c.moe_layers]}

    def layer_stats(self) -> list[dict]:
        """Per MoE layer: hits, misses and bytes read since start."""
        return [{"layer": il, "hits": c[0], "misses": c[1], "bytes_read": c[2]} for il, c in sorted(self.by_layer.items())]

    def drives(self) -> list[dict]:
        """The drives the experts are read from, and how each reads (drives.py)."""
        return self.reader.drives.describe()

    def describe(self) -> dict:
        return {"placement": "expert cache", "policy": self.policy.as_dict(), "main_slots": self.main_slots,
                "window_slots_per_layer": self.slots_per_layer if self.main_slots else None, "pinned_bytes": self.pinned_bytes,
                "pinned": sorted(f"{il}:{ie}" for il, ie in self.hand_pins), "learned_pins": len(self.pinned) - len(
                    self.hand_pins), "pinned_size_by": "operator" if self.pinned_set_by_hand else "policy",
                "history": self.history.describe(), "budget_bytes": self.budget_bytes,
                "arena_bytes": self.arena_bytes, "slots": self.n_slots, "slots_per_layer": self.slots_per_layer,
                "record_bytes": self.record_bytes, **self.reader.describe(), "mlock": self._arena.mlock,
                "hugepages": self._arena.hugepages}
