"""What a sequence keeps between steps, and how a step lays sequences out: the KV pool
(every sequence's state in blocks of KV_BLOCK positions, shared by the prefix cache), a
sequence's cache over it (KVCache: its block table and position), and a forward step's
segments (one per sequence: its rows of the batch). Attention reads and writes a sequence
through its KVCache; a hybrid family's linear-attention layers keep a fixed-size recurrent
state per sequence beside it (KVCache.state: the state matrices and a short convolution's
last inputs, engine/recurrent.py), which moves only forward."""

import mmap
import os
import weakref
from dataclasses import dataclass

import numpy as np

KV_BLOCK = 16  # positions a KV block holds (the prefix cache shares whole blocks)
STATE = "state:"  # a snapshot's names of the recurrent state's arrays begin with it


class KVExhausted(MemoryError):
    """The KV pool has no free block: every block of RAM it may use holds a running
    sequence's positions or a cached prefix."""


class KVPool:
    """Every sequence's KV state of one model, in blocks of KV_BLOCK positions: per name
    (keys, values, a latent, an indexer's keys), one array [blocks, layers, heads, KV_BLOCK,
    width], and views into them (MLA's values are the first columns of its latent). A
    sequence holds a table of its blocks in position order; a block is held by every
    sequence whose table has it and by the prefix cache (engine/prefix.py), so a shared
    prefix exists once and is never copied, and it returns to the free list when nobody
    holds it. The arrays lie in one reservation of address space the size of RAM
    (MAP_NORESERVE): a block's pages are committed when first written, and given back
    (madvise) when it is freed, where a block's part of an array is whole pages."""

    def __init__(self, shapes: dict[str, tuple[int, int, int]], views: dict[str, tuple[str, int]] | None = None,
                 reserve: int | None = None):
        # shapes: name -> (layers, heads, width); views: name -> (the array it looks into, its first columns)
        self.shapes = shapes
        self.part_bytes = {n: L * H * KV_BLOCK * d * 4 for n, (L, H, d) in shapes.items()}  # a block, per array
        self.block_bytes = sum(self.part_bytes.values())
        reserve = reserve or os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        self.n_blocks = max(8, reserve // self.block_bytes)
        while True:
            try:  # (strict overcommit counts the reservation: ask for less until it is granted)
                self.maps = {n: mmap.mmap(-1, self.n_blocks * size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
                                          | 0x4000) for n, size in self.part_bytes.items()}  # 0x4000: MAP_NORESERVE
                break
            except OSError:
                if self.n_blocks <= 8:
                    raise
                self.n_blocks //= 2
        self.arrays = {n: np.frombuffer(self.maps[n], np.float32).reshape(self.n_blocks, L, H, KV_BLOCK, d)
                       for n, (L, H, d) in shapes.items()}
        for n, (base, cols) in (views or {}).items():
            self.arrays[n] = self.arrays[base][..., :cols]
        self.refs = np.zeros(self.n_blocks, np.int32)  # (calloc'd: its pages too are committed as used)
        self.free: list[int] = []  # blocks given back, reused first; then the untouched ones from `fresh` on
        self.fresh = 0
        self.page = mmap.PAGESIZE

    @property
    def used(self) -> int:
        return self.fresh - len(self.free)

    def alloc(self) -> int:
        if self.free:
            b = self.free.pop()
        elif self.fresh < self.n_blocks:
            b, self.fresh = self.fresh, self.fresh + 1
        else:
            raise KVExhausted(f"the KV cache is full: {self.n_blocks} blocks of {KV_BLOCK} positions in use")
        self.refs[b] = 1
        return b

    def hold(self, b: int) -> None:
        self.refs[b] += 1

    def drop(self, blocks) -> None:
        for b in blocks:
            self.refs[b] -= 1
            if self.refs[b] == 0:
                self.free.append(b)
                for n, m in self.maps.items():
                    size = self.part_bytes[n]
                    if size % self.page == 0:  # its pages back to the system
                        m.madvise(mmap.MADV_DONTNEED, b * size, size)


class KVCache:
    """One sequence's KV state, up to n_ctx positions: a table of the pool's blocks in
    position order (the attention kernels read the blocks through it). Positions are only
    ever appended, so a block once full never changes: the prefix cache can share it."""

    def __init__(self, pool: KVPool, n_ctx: int, flat: frozenset = frozenset(),
                 state: dict[str, tuple] | None = None):
        # flat: names whose saved form has no heads axis (take/put; DSA's indexer keys);
        # state: name -> shape of the sequence's fixed-size recurrent state (zeros at start)
        self.pool, self.n_ctx, self.flat = pool, n_ctx, flat
        self.state = {name: np.zeros(shape, np.float32) for name, shape in (state or {}).items()}
        self.n_pos = 0  # positions filled
        self.table = np.zeros(-(-n_ctx // KV_BLOCK), np.int64)  # its blocks, in position order
        self.blocks: list[int] = []  # the same, as held (released when the cache goes)
        weakref.finalize(self, pool.drop, self.blocks)

    @property
    def state_bytes(self) -> int:
        return sum(a.nbytes for a in self.state.values())

    def cover(self, n: int) -> None:
        """Blocks for the first n positions."""
        while len(self.blocks) * KV_BLOCK < n:
            b = self.pool.alloc()
            self.table[len(self.blocks)] = b
            self.blocks.append(b)

    def adopt(self, blocks: list[int]) -> None:
        """Start from shared blocks (a cached prefix): its first len(blocks) * KV_BLOCK
        positions, held, not copied."""
        assert not self.blocks
        for b in blocks:
            self.pool.hold(b)
            self.table[len(self.blocks)] = b
            self.blocks.append(b)
        self.n_pos = len(blocks) * KV_BLOCK

    def write(self, name: str, il: int, pos0: int, x: np.ndarray) -> None:
        """x [n, heads, width] at positions pos0.. of layer il of array `name`."""
        self.cover(pos0 + len(x))
        arr = self.pool.arrays[name]
        for j0 in range(pos0 - pos0 % KV_BLOCK, pos0 + len(x), KV_BLOCK):
            lo, hi = max(pos0, j0), min(pos0 + len(x), j0 + KV_BLOCK)
            b = self.table[j0 // KV_BLOCK]
            if self.pool.refs[b] > 1:
                raise AssertionError("a shared KV block written to")  # (positions are appended: never)
            arr[b, il, :, lo - j0 : hi - j0] = x[lo - pos0 : hi - pos0].transpose(1, 0, 2)

    def gather(self, name: str, il: int, head: int, n: int, start: int = 0) -> np.ndarray:
        """A copy of positions start..n-1 of one head of layer il: [n - start, width] (for
        numpy code that wants them in one array)."""
        arr = self.pool.arrays[name]
        b0, nb = start // KV_BLOCK, -(-n // KV_BLOCK)
        return arr[self.table[b0:nb], il, head].reshape((nb - b0) * KV_BLOCK, -1)[start - b0 * KV_BLOCK : n - b0 * KV_BLOCK]

    def take(self, start: int, stop: int) -> dict[str, np.ndarray]:
        """Copies of positions start..stop-1 of every array: [layers, heads, n, width] (the
        names in `flat`: [layers, n, width]) (a session's snapshot)."""
        out = {}
        for name, (L, H, d) in self.pool.shapes.items():
            arr = self.pool.arrays[name]
            b0, b1 = start // KV_BLOCK, -(-stop // KV_BLOCK)
            got = arr[self.table[b0:b1]].transpose(1, 2, 0, 3, 4).reshape(L, H, (b1 - b0) * KV_BLOCK, d)
            got = np.ascontiguousarray(got[:, :, start - b0 * KV_BLOCK : stop - b0 * KV_BLOCK])
            out[name] = got[:, 0] if name in self.flat else got
        return out

    def put(self, state: dict[str, np.ndarray], start: int) -> None:
        """Write `state` (take()'s arrays, of any number of positions) at positions from
        `start` on."""
        for name, x in state.items():
            x = x[:, None] if name in self.flat else x  # [L, H, n, d]
            for il in range(x.shape[0]):
                self.write(name, il, start, x[il].transpose(1, 0, 2))

    def snapshot(self) -> dict[str, np.ndarray]:
        """Copies of the filled positions of every array, and of the recurrent state (under
        STATE + its name) (a session keeps them)."""
        return self.take(0, self.n_pos) | {STATE + name: a.copy() for name, a in self.state.items()}

    def restore(self, state: dict[str, np.ndarray], n_pos: int | None = None) -> None:
        """Fill the first n_pos positions (None: all of them) of this fresh cache from a
        snapshot of a cache of the same model. Raises ValueError when its arrays do not fit
        this cache or hold fewer positions (or, with a recurrent state, other positions than
        it saw: the state cannot be cut back)."""
        recurrent = {k[len(STATE):]: v for k, v in state.items() if k.startswith(STATE)}
        state = {k: v for k, v in state.items() if not k.startswith(STATE)}
        if set(recurrent) != set(self.state):
            raise ValueError(f"the saved recurrent state holds {sorted(recurrent)}, this model's {sorted(self.state)}")
        for name, a in recurrent.items():
            if a.shape != self.state[name].shape or a.dtype != np.float32:
                raise ValueError(f"the saved {name} state is {a.dtype}{list(a.shape)}, this model's "
                                 f"float32{list(self.state[name].shape)}")
        shapes = self.pool.shapes
        if set(state) != set(shapes):
            raise ValueError(f"the saved cache holds {sorted(state)}, this model's holds {sorted(shapes)}")
        axis = {name: 1 if name in self.flat else 2 for name in shapes}
        n = {state[name].shape[axis[name]] if state[name].ndim > axis[name] else -1 for name in shapes}
        if len(n) != 1:
            raise ValueError("the saved cache's arrays hold different numbers of positions")
        saved = n.pop()
        n_pos = saved if n_pos is None else n_pos
        if n_pos > saved:
            raise ValueError(f"the saved cache holds {saved} positions, fewer than the {n_pos} its tokens need")
        if recurrent and n_pos != saved:
            raise ValueError(f"the saved recurrent state has seen {saved} positions, not the {n_pos} asked for")
        if n_pos > self.n_ctx:
            raise ValueError("the saved cache's positions do not fit this cache")
        for name, (L, H, d) in shapes.items():
            want = (L, saved, d) if name in self.flat else (L, H, saved, d)
            if state[name].shape != want or state[name].dtype != np.float32:
                raise ValueError(f"the saved {name} is {state[name].dtype}{list(state[name].shape)}, this model's "
                                 f"float32{list(want)}")
        self.put({name: along(state[name], axis[name], 0, n_pos) for name in shapes}, 0)
        for name, a in recurrent.items():
            self.state[name][...] = a
        self.n_pos = n_pos


def along(a: np.ndarray, axis: int, start: int, stop: int) -> np.ndarray:
    # a view of a's positions start..stop-1 on `axis`
    cut = [slice(None)] * a.ndim
    cut[axis] = slice(start, stop)
    return a[tuple(cut)]


@dataclass
class Segment:
    """One sequence's rows in a batched forward step."""

    cache: KVCache
    start: int  # first row in the batch
    n: int  # rows (tokens) of this sequence in the step


@dataclass
class Step:
    """A forward step over several sequences: their tokens are the rows of one batch (so
    every matrix is read once per step, and a layer's experts are the union over all of
    them); attention is per sequence, against its own KV cache."""

    segments: list[Segment]
    cos: np.ndarray  # [T, hd/2] at each row's position
    sin: np.ndarray
