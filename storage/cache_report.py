"""What the expert cache reports: where each expert is and how hot (the live map), per-layer
hits, misses and bytes, the drives, and the cache's whole description for `stats`. One part
of ExpertCache (cache.py), over its state; the counters themselves are ExpertStats
(experts.py), counted where the work happens.
"""


class CacheReport:
    """The expert cache's reports (see above)."""

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
        return {"placement": "expert cache", "experts_kind": self.c.expert_dtype, "policy": self.policy.as_dict(), "main_slots": self.main_slots,
                "window_slots_per_layer": self.slots_per_layer if self.main_slots else None, "pinned_bytes": self.pinned_bytes,
                "pinned": sorted(f"{il}:{ie}" for il, ie in self.hand_pins), "learned_pins": len(self.pinned) - len(
                    self.hand_pins), "pinned_size_by": "operator" if self.pinned_set_by_hand else "policy",
                "history": self.history.describe(), "budget_bytes": self.budget_bytes,
                "arena_bytes": self.arena_bytes, "slots": self.n_slots, "slots_per_layer": self.slots_per_layer,
                "record_bytes": self.record_bytes, **self.reader.describe(), "mlock": self._arena.mlock,
                "hugepages": self._arena.hugepages}
