"""Embedding tables streamed from disk (Qwen4-Exp's n-gram tables): the second thing colibri
streams beside the experts. A table stays in the container's dense file, where convert
wrote it, and its 4 KiB pages are checksummed apart (`tables.crc`, one crc32 per page,
listed in the manifest's `tables`), so a table never has to be resident: a step reads the
pages holding the rows its tokens index, under a byte budget of its own (TableCache: least
recently used pages go first), with aligned O_DIRECT reads on a thread of its own, started
as soon as the step's token ids are known (prefetch) and waited for when a layer takes its
rows. A page that does not match its checksum is read again once, then named
(ExpertReadError). A token reads (ngram_size - 1) x heads_per_ngram rows a PLE layer; the
cache's hit rate and bytes read are in stats()."""

import mmap
import os
import threading
import zlib
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from .container import ContainerInvalid
from .errors import ExpertReadError
from .safetensors import bf16_to_f32

PAGE = 4096
CRC_FILE = "tables.crc"  # uint32 little-endian, every table's page checksums one after another
DTYPES = {"F32": np.float32, "BF16": np.uint16, "F16": np.float16}


def page_span(begin: int, end: int) -> tuple[int, int]:
    """The file's 4 KiB pages [first, last + 1) holding bytes begin..end."""
    return begin // PAGE, -(-end // PAGE)


def page_crcs(path: str, begin: int, end: int) -> np.ndarray:
    """crc32 of each file page holding bytes begin..end (the last page as far as the file goes)."""
    first, stop = page_span(begin, end)
    out = np.empty(stop - first, np.uint32)
    with open(path, "rb") as f:
        f.seek(first * PAGE)
        for i in range(stop - first):
            out[i] = zlib.crc32(f.read(PAGE))
    return out


class StreamedTable:
    """One table [rows, width] of the dense file, read a page at a time through its cache."""

    nbytes = 0  # (resident: none of it; its pages are the cache's, TableCache.stats)

    def __init__(self, cache: "TableCache", name: str, spec: dict, crcs: np.ndarray):
        self.cache, self.name = cache, name
        self.begin, self.shape, self.dtype = int(spec["begin"]), tuple(spec["shape"]), spec["dtype"]
        self.np_dtype = DTYPES[self.dtype]
        self.row_bytes = self.shape[1] * np.dtype(self.np_dtype).itemsize
        self.first_page = self.begin // PAGE
        self.crcs = crcs  # [pages]

    def pages_of(self, rows: np.ndarray) -> np.ndarray:
        # the file pages each row's bytes lie on (a row may straddle two)
        start = self.begin + rows.astype(np.int64) * self.row_bytes
        return np.unique(np.concatenate([start // PAGE, (start + self.row_bytes - 1) // PAGE]))

    def prefetch(self, rows: np.ndarray) -> None:
        """Start reading the pages rows [any shape] lie on (those not cached yet)."""
        self.cache.prefetch(self, self.pages_of(np.asarray(rows).reshape(-1)))

    def rows(self, rows: np.ndarray) -> np.ndarray:
        """rows [any shape] int -> their values [..., width] float32 (waiting for any pending read)."""
        flat = np.asarray(rows).reshape(-1)
        pages = self.cache.take(self, self.pages_of(flat))  # page -> its bytes
        out = np.empty((len(flat), self.shape[1]), self.np_dtype)
        raw = out.view(np.uint8).reshape(len(flat), self.row_bytes)
        for i, r in enumerate(flat.tolist()):
            a = self.begin + r * self.row_bytes
            got = 0
            while got < self.row_bytes:
                p, off = divmod(a + got, PAGE)
                n = min(PAGE - off, self.row_bytes - got)
                raw[i, got : got + n] = pages[p][off : off + n]
                got += n
        vals = bf16_to_f32(out) if self.dtype == "BF16" else out.astype(np.float32)
        return vals.reshape(*np.shape(rows), self.shape[1])


class TableCache:
    """The streamed tables' pages, under one byte budget (at least a step's pages are held
    while it takes them); reads on a thread of its own, O_DIRECT where the file system
    allows it."""

    def __init__(self, container, budget: int, direct: bool = True):
        self.budget_pages = max(0, int(budget) // PAGE)
        self.path = os.path.join(container.path, container.dense_file)
        crc_path = os.path.join(container.path, CRC_FILE)
        try:
            all_crcs = np.fromfile(crc_path, dtype="<u4")
        except OSError as e:
            raise ContainerInvalid(f"{crc_path}: {e.strerror or e}") from None
        self.tables = {}
        for name, spec in container.tables.items():
            first, stop = page_span(int(spec["begin"]), int(spec["end"]))
            i = int(spec["crc_index"])
            if i + stop - first > len(all_crcs):
                raise ContainerInvalid(f"{crc_path}: {name!r}'s page checksums run past the file's end")
            self.tables[name] = StreamedTable(self, name, spec, all_crcs[i : i + stop - first])
        flags = os.O_RDONLY | (getattr(os, "O_DIRECT", 0) if direct else 0)
        try:
            self.fd = os.open(self.path, flags)
        except OSError:  # (a file system without O_DIRECT: through the page cache)
            self.fd = os.open(self.path, os.O_RDONLY)
        self.pages: OrderedDict = OrderedDict()  # page -> bytes, least recently used first
        self.pending: dict[int, Future] = {}
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="colibri-tables")
        self.lock = threading.Lock()
        self.hits = self.misses = self.bytes_read = 0

    def table(self, name: str) -> StreamedTable:
        return self.tables[name]

    def _read(self, table: StreamedTable, page: int) -> np.ndarray:
        buf = mmap.mmap(-1, PAGE)  # page aligned, as O_DIRECT wants
        for _ in range(2):
            n = os.preadv(self.fd, [buf], page * PAGE)
            data = np.frombuffer(buf, np.uint8, n).copy()
            if zlib.crc32(data) == int(table.crcs[page - table.first_page]):
                with self.lock:
                    self.bytes_read += PAGE
                return np.concatenate([data, np.zeros(PAGE - n, np.uint8)]) if n < PAGE else data
        raise ExpertReadError(f"{self.path}: page {page} of table {table.name!r} does not match its checksum "
                              "(read twice)")

    def prefetch(self, table: StreamedTable, pages: np.ndarray) -> None:
        with self.lock:
            todo = [int(p) for p in pages if p not in self.pages and p not in self.pending]
            for p in todo:
                self.pending[p] = self.pool.submit(self._read, table, p)

    def take(self, table: StreamedTable, pages: np.ndarray) -> dict:
        """The pages' bytes (read now those neither cached nor pending), then the cache cut
        back to its budget."""
        out = {}
        for p in (int(p) for p in pages):
            with self.lock:
                got, fut = self.pages.get(p), self.pending.pop(p, None)
                if got is not None:
                    self.pages.move_to_end(p)
                    self.hits += 1
            if got is None:
                got = fut.result() if fut is not None else self._read(table, p)
                with self.lock:
                    self.misses += 1
                    self.pages[p] = got
            out[p] = got
        with self.lock:
            while len(self.pages) > self.budget_pages:
                self.pages.popitem(last=False)
        return out

    def stats(self) -> dict:
        taken = self.hits + self.misses
        return {"budget_bytes": self.budget_pages * PAGE, "resident_bytes": len(self.pages) * PAGE,
                "bytes_read": self.bytes_read, "hit_rate": round(self.hits / taken, 4) if taken else None,
                "pages_taken": taken}

    def close(self) -> None:
        self.pool.shutdown(wait=True)
        os.close(self.fd)
