"""Embedding tables streamed from disk (Qwen4-Exp's n-gram tables): the second thing colibri
streams beside the experts. A table stays in the container's dense file, where convert
wrote it, and its 4 KiB pages are checksummed apart (`tables.crc`, one crc32 per page,
listed in the manifest's `tables`), so a table never has to be resident: a step reads the
pages holding the rows its tokens index, under a byte budget of its own (TableCache: least
recently used pages go first). The pages are read by the experts' reader (reader.py): on
its drives' threads, O_DIRECT, each page from the drive its stripe unit hashes to when
`drives:` copies hold the tables too (`colictl drives stage` copies the dense file's
header and table pages), started as soon as the step's token ids are known (prefetch) and
waited for when a layer takes its rows. Every page read is checked against its crc32
(whatever `verify` says: a page is small and read again as often as it is evicted); a
page that does not match is read again, then from each other drive, then named
(ExpertReadError). A token reads (ngram_size - 1) x heads_per_ngram rows a PLE layer; the
cache's hit rate and bytes read are in stats()."""

import os
import threading
from collections import OrderedDict
from concurrent.futures import Future

import numpy as np

from .checksum import crc32
from .container import ContainerInvalid
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
            out[i] = crc32(f.read(PAGE))
    return out


def streamed_table_bytes(container) -> int:
    """The bytes of the dense file's tables a container streams; 0 for none."""
    return sum(int(t["end"]) - int(t["begin"]) for t in (getattr(container, "tables", None) or {}).values())


def streamed_tables_file(container) -> tuple[str, int] | None:
    """(path, header bytes) of the dense file when the container has streamed tables: the
    reader opens it on every drive holding a copy, whose header must be the container's."""
    if not getattr(container, "tables", None):
        return None
    path = os.path.join(container.path, container.dense_file)
    with open(path, "rb") as f:
        return path, 8 + int.from_bytes(f.read(8), "little")


class TablePages:
    """Where a container's streamed tables lie in its dense file (`path`) and their pages'
    checksums: {name: (spec, first page, crcs [pages])}. Raises ContainerInvalid when
    tables.crc is missing or short."""

    def __init__(self, container):
        self.path = os.path.join(container.path, container.dense_file)
        crc_path = os.path.join(container.path, CRC_FILE)
        try:
            all_crcs = np.fromfile(crc_path, dtype="<u4")
        except OSError as e:
            raise ContainerInvalid(f"{crc_path}: {e.strerror or e}") from None
        self.tables: dict[str, tuple[dict, int, np.ndarray]] = {}
        for name, spec in container.tables.items():
            first, stop = page_span(int(spec["begin"]), int(spec["end"]))
            i = int(spec["crc_index"])
            if i + stop - first > len(all_crcs):
                raise ContainerInvalid(f"{crc_path}: {name!r}'s page checksums run past the file's end")
            self.tables[name] = (spec, first, all_crcs[i:i + stop - first])

    def spans(self) -> list[tuple[int, int]]:
        """The byte ranges [begin, end) of the dense file its tables' pages cover, merged, in order."""
        out: list[list[int]] = []
        for _, first, crcs in sorted(self.tables.values(), key=lambda t: t[1]):
            a, b = first * PAGE, (first + len(crcs)) * PAGE
            if out and a <= out[-1][1]:
                out[-1][1] = max(out[-1][1], b)
            else:
                out.append([a, b])
        return [(a, b) for a, b in out]

    def problems(self, data: np.ndarray, at: int) -> list[str]:
        """The table pages wholly inside `data` (the file's bytes from `at`, a page boundary;
        the file's last page may be short) that do not match their checksum, named."""
        out = []
        lo, hi = at // PAGE, (at + len(data) + PAGE - 1) // PAGE
        for name, (_, first, crcs) in self.tables.items():
            for p in range(max(lo, first), min(hi, first + len(crcs))):
                o = p * PAGE - at
                if crc32(data[o:o + PAGE]) != int(crcs[p - first]):
                    out.append(f"page {p} of table {name!r} does not match its checksum")
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
    while it takes them), read by the expert reader `reader` (reader.py ExpertReader: its
    drives and their threads)."""

    def __init__(self, container, budget: int, reader):
        self.budget_pages = max(0, int(budget) // PAGE)
        self.reader = reader
        self.index = TablePages(container)
        self.path = self.index.path
        self.table_bytes = streamed_table_bytes(container)  # (all of them: what `table_cache: all` reads in)
        self.tables = {name: StreamedTable(self, name, spec, crcs)
                       for name, (spec, _, crcs) in self.index.tables.items()}
        self.pages: OrderedDict = OrderedDict()  # page -> bytes, least recently used first
        self.pending: dict[int, Future] = {}
        self.lock = threading.Lock()
        self.hits = self.misses = self.bytes_read = 0

    def table(self, name: str) -> StreamedTable:
        return self.tables[name]


    def _submit(self, table: StreamedTable, page: int) -> Future:
        return self.reader.submit_page(self.path, page * PAGE, PAGE, int(table.crcs[page - table.first_page]),
                                       f"{self.path}: page {page} of table {table.name!r}")

    def _landed(self, data: np.ndarray) -> np.ndarray:
        """A page read (PAGE bytes, zeros past the file's end), counted."""
        with self.lock:
            self.bytes_read += PAGE
        return np.concatenate([data, np.zeros(PAGE - len(data), np.uint8)]) if len(data) < PAGE else data

    def prefetch(self, table: StreamedTable, pages: np.ndarray) -> None:
        with self.lock:
            todo = [int(p) for p in pages if p not in self.pages and p not in self.pending]
            for p in todo:
                self.pending[p] = self._submit(table, p)

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
                got = self._landed((fut or self._submit(table, p)).result())
                with self.lock:
                    self.misses += 1
                    self.pages[p] = got
            out[p] = got
        self.resize(self.budget_pages * PAGE)
        return out

    def resize(self, budget: int) -> None:
        """A (new) byte budget, now: the least recently used pages beyond it go."""
        with self.lock:
            self.budget_pages = max(0, int(budget) // PAGE)
            while len(self.pages) > self.budget_pages:
                self.pages.popitem(last=False)

    def stats(self) -> dict:
        taken = self.hits + self.misses
        return {"budget_bytes": self.budget_pages * PAGE, "resident_bytes": len(self.pages) * PAGE,
                "bytes_read": self.bytes_read, "hit_rate": round(self.hits / taken, 4) if taken else None,
                "pages_taken": taken}
