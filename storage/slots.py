"""The expert cache's slot bookkeeping: the arena cut into record-sized slots, and who holds
each one. The slots are split as the policy says (policy.py): a pinned part (hand pins, and
the learned hot set) whose experts are never evicted; for `lru` and `lru+pinned` an equal
LRU share per MoE layer; for `learned` a small LRU window per layer and one main region for
all layers, kept by usage (an admission moves no bytes: slots change owner). Budgets are
resolved and checked here too (`budget_bytes`), the one place the daemon, plan and tune
take them from.

SlotBook is one part of ExpertCache (cache.py), whose streaming path takes and gives back
slots through it between and during steps; the parts share the cache's state, since the
decode path reads the slot maps directly (an object between them would cost a lookup per
expert on every layer of every token). It uses the cache's `c` (the container),
`record_bytes`, `policy`, `history`, `stats`, `reader`, `top_k`, `room`, `beside` and the
arena flags; everything else it keeps itself.
"""

from collections import OrderedDict, deque

import numpy as np

from .arena import allocate
from .errors import BudgetInvalid, ExpertReadError
from .memory import MemoryRoom
from .policy import Policy, learned_slots, plan_repin, victim
from .sizes import fmt_bytes


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


class SlotBook:
    """Who holds each slot of the cache's arena, and how a budget becomes slots (see above)."""

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
            self.stats.bytes_read += rec.length
        self.pinned[key] = slot
        self.hand_pins.add(key)

    def unpin(self, il: int, ie: int) -> None:
        """Let the expert be evicted again. Raises KeyError if it is not pinned."""
        self.pin_free.append(self.pinned.pop((il, ie)))
        self.hand_pins.discard((il, ie))

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
