"""How much RAM a budget may take on this box: the machine's memory (or its cgroup's
limit, when lower), less the resident dense weights and what the process itself needs.

A budget above it would not fail at once: the arena is virtual memory, touched as experts
land, so the process would grow for hours until the kernel's out-of-memory killer ends it.
Every budget (the expert cache at the command line, in the configuration and at runtime;
the prefix cache) is checked here first, and the refusal names the limit and what it is
made of.
"""

import os
from dataclasses import dataclass

from .errors import BudgetInvalid
from .sizes import fmt_bytes

# the interpreter, numpy, numba and its compiled kernels, the tokenizer, a step's
# temporaries and a few requests' KV. Measured beyond the budget and the dense weights on the
# 8-layer benchmark model (int4 experts, int8 dense and activations, 262 MiB budget): 142 MB
# anonymous (a load's largest tensor read twice, the kernels' code) and 95 MB of mapped
# libraries, which a memory cgroup charges too: 237 MB, so 320 MiB leaves a margin
PROCESS_BYTES = 320 << 20
def cgroup_limit_files(proc_cgroup: str = "/proc/self/cgroup") -> list[str]:
    """The memory limit files of this process's cgroup and each of its ancestors, cgroup v2
    (memory.max) or v1's memory controller (memory.limit_in_bytes). Only the root's had been
    read: a process in a service's or a cgroup's own (systemd's MemoryMax=, a memory cgroup
    of 25 % of a model, benchmarks/peer.py) saw the whole machine, and placing it let its
    budgets grow past the limit into the kernel's OOM killer."""
    try:
        with open(proc_cgroup) as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    files = []
    for line in lines:
        hid, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if hid == "0" and not controllers:
            root, name = "/sys/fs/cgroup", "memory.max"
        elif "memory" in controllers.split(","):
            root, name = "/sys/fs/cgroup/memory", "memory.limit_in_bytes"
        else:
            continue
        parts = [p for p in path.split("/") if p and p != ".."]
        files += [os.path.join(root, *parts[:i], name) for i in range(len(parts), -1, -1)]
    return files


def ram_bytes() -> int:
    """The memory this process may use: the machine's, or the lowest limit of its cgroup and
    their ancestors when lower."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for path in cgroup_limit_files():
        try:
            with open(path) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text.isdigit():
            total = min(total, int(text))  # v1 says "no limit" with a number near 2**63
    return total


@dataclass(frozen=True)
class MemoryRoom:
    """The RAM budgets may share: `ram` less `dense_bytes`, `table_bytes` and PROCESS_BYTES."""

    dense_bytes: int
    ram: int = 0  # 0: ram_bytes()
    table_bytes: int = 0  # a container's streamed tables: their cache's budget (tables.py), all of them when resident

    @property
    def total(self) -> int:
        return self.ram or ram_bytes()

    @property
    def bytes(self) -> int:
        return max(0, self.total - self.dense_bytes - self.table_bytes - PROCESS_BYTES)

    def check(self, what: str, asked: int, beside: int = 0, beside_what: str = "") -> None:
        """Raises BudgetInvalid when `asked` bytes for `what` do not fit beside `beside`
        bytes other budgets already take (named by `beside_what`)."""
        room = max(0, self.bytes - beside)
        if asked > room:
            other = f", less {fmt_bytes(beside)} for {beside_what}" if beside else ""
            raise BudgetInvalid(
                f"{what} of {fmt_bytes(asked)} is above this box's limit of {fmt_bytes(room)} ({room} bytes: "
                f"{fmt_bytes(self.total)} of RAM less {fmt_bytes(self.dense_bytes)} of dense weights"
                f"{f', {fmt_bytes(self.table_bytes)} for the embedding tables' if self.table_bytes else ''} and "
                f"{fmt_bytes(PROCESS_BYTES)} for the process{other})")

    def check_tables(self, what: str, beside: int = 0, beside_what: str = "") -> None:
        """Raises BudgetInvalid when its `table_bytes` (named by `what`) do not fit beside
        `beside` bytes of other budgets."""
        MemoryRoom(self.dense_bytes, self.ram).check(what, self.table_bytes, beside, beside_what)
