"""Copies of a container's expert files on another drive: staged (resumable, every record
checked against the manifest on the way and the copy read back from the drive) and
verified. The reader uses a copy as one of its drives (drives.py). A container with
streamed tables (tables.py) has its dense file staged too, as a sparse copy: the header
and the tables' pages, each checked against tables.crc; the dense weights between are
holes, since the dense weights are never read from a copy.

A copy in progress is NAME.part; a finished one is renamed to NAME once read back whole
and right. DEST/colibri-drive.json records whose container the copies are (its
fingerprint), so a directory is never half one model and half another. An interrupted
stage resumes from the last whole record of the .part file.
"""

import json
import mmap
import os
import time
from collections.abc import Callable

import numpy as np

from .checksum import crc32
from .container import Container, ExpertRecord
from .errors import ColibriError
from .tables import TablePages, streamed_tables_file

STATE = "colibri-drive.json"
CHUNK_BYTES = 8 << 20  # copied and read back this much at a time (whole records)


class StageError(ColibriError):
    """A copy cannot be staged: the directory holds another container's copies, or the
    container's own record is damaged (named)."""


Progress = Callable[[int], None]  # bytes done since the last call


def expert_files(c: Container) -> dict[str, list[ExpertRecord]]:
    """The container's expert files (absolute paths) and their records in file order."""
    files: dict[str, list[ExpertRecord]] = {}
    for r in c.records.values():
        files.setdefault(r.file, []).append(r)
    return {f: sorted(rs, key=lambda r: r.offset) for f, rs in sorted(files.items())}


def staged_files(c: Container) -> list[str]:
    """The container's files a drive's copy holds: its expert files, and its dense file
    when it has streamed tables."""
    tables = streamed_tables_file(c)
    return [*expert_files(c), *([tables[0]] if tables else [])]


def file_bytes(c: Container, file: str) -> int:
    """The bytes staging copies of one of staged_files (what its progress counts)."""
    tables = streamed_tables_file(c)
    if tables and file == tables[0]:
        return tables[1] + sum(n for _, n in table_chunks(TablePages(c), os.path.getsize(file)))
    return os.path.getsize(file)


def _read_state(dest: str, c: Container) -> dict:
    path = os.path.join(dest, STATE)
    try:
        with open(path) as f:
            state = json.load(f)
    except FileNotFoundError:
        return {"container": c.fingerprint, "source": c.path, "files": {}}
    except (OSError, ValueError) as e:
        raise StageError(f"{path}: unreadable ({e}); remove it to stage again") from None
    if state.get("container") != c.fingerprint:
        raise StageError(f"{dest} holds copies of another container ({state.get('container')}, from "
                         f"{state.get('source')}); stage into an empty directory")
    return state


def _write_state(dest: str, state: dict) -> None:
    tmp = os.path.join(dest, STATE + ".tmp")
    with open(tmp, "w") as f:
        json.dump(state, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(dest, STATE))


def _aligned(n: int) -> np.ndarray:
    return np.frombuffer(mmap.mmap(-1, max(n, mmap.PAGESIZE)), np.uint8)[:n]


def check_copy(c: Container, file: str, copy: str, progress: Progress | None = None) -> list[str]:
    """What is wrong with `copy` of the container's file `file` (empty: nothing): its size,
    its header, and every expert record's crc32 against the manifest (or every table page's
    against tables.crc), read from the drive itself (O_DIRECT where the file system allows it)."""
    tables = streamed_tables_file(c)
    is_tables = tables is not None and file == tables[0]
    records = [] if is_tables else expert_files(c)[file]
    try:
        size = os.path.getsize(copy)
    except OSError as e:
        return [f"{copy}: {e.strerror}"]
    if size != os.path.getsize(file):
        return [f"{copy}: {size} bytes, the container's file has {os.path.getsize(file)}"]
    problems = []
    with open(file, "rb") as a, open(copy, "rb") as b:
        head = tables[1] if is_tables else records[0].offset
        if a.read(head) != b.read(head):
            problems.append(f"{copy}: the header differs from the container's")
    try:
        fd = os.open(copy, os.O_RDONLY | os.O_DIRECT)
    except OSError:
        fd = os.open(copy, os.O_RDONLY)
    try:
        if is_tables:
            return problems + _check_tables(TablePages(c), fd, size, progress)
        per = max(1, CHUNK_BYTES // c.record_bytes)
        buf = _aligned(per * c.record_bytes)
        for i in range(0, len(records), per):
            run = records[i:i + per]
            n = run[-1].offset + run[-1].length - run[0].offset
            got = os.preadv(fd, [memoryview(buf[:n])], run[0].offset)
            for r in run:
                at = r.offset - run[0].offset
                if got < at + r.length:
                    problems.append(f"layer {r.layer} expert {r.expert}: short read at offset {r.offset}")
                elif crc32(buf[at:at + r.length]) != r.crc32:
                    problems.append(f"layer {r.layer} expert {r.expert}: checksum mismatch at offset {r.offset}")
            if progress:
                progress(n)
    finally:
        os.close(fd)
    return problems


def table_chunks(pages: TablePages, size: int) -> list[tuple[int, int]]:
    """(offset, bytes) of the dense file a tables copy holds beyond its header, in chunks
    of at most CHUNK_BYTES (page aligned; the last ends at the file's end)."""
    return [(at, min(CHUNK_BYTES, min(b, size) - at)) for a, b in pages.spans() for at in range(a, min(b, size),
                                                                                              CHUNK_BYTES)]


def _check_tables(pages: TablePages, fd: int, size: int, progress: Progress | None) -> list[str]:
    buf = _aligned(CHUNK_BYTES)
    problems = []
    for at, n in table_chunks(pages, size):
        got = os.preadv(fd, [memoryview(buf[:-(-n // 4096) * 4096])], at)
        problems += [f"short read at offset {at}"] if got < n else pages.problems(buf[:n], at)
        if progress:
            progress(n)
    return problems


def _copy_tables(c: Container, file: str, part: str, progress: Progress | None) -> None:
    """Copy the dense file's header and its tables' pages into `part` (the weights between
    left as holes), from the first chunk an earlier copy did not finish, checking each page
    against tables.crc as it is read."""
    pages, head = TablePages(c), streamed_tables_file(c)[1]
    have = os.path.getsize(part) if os.path.exists(part) else 0
    size = os.path.getsize(file)
    with open(file, "rb") as src, open(part, "r+b" if have else "wb") as out:
        out.write(src.read(head))  # (small: always copied again)
        if progress:
            progress(head)
        for at, n in table_chunks(pages, size):
            if at + n > have:  # (the chunks before the copy's end were written whole)
                src.seek(at)
                data = src.read(n)
                bad = pages.problems(np.frombuffer(data, np.uint8), at)
                if bad:
                    raise StageError(f"{file}: {bad[0]}: the container itself is damaged (colictl doctor --deep)")
                out.seek(at)
                out.write(data)
            if progress:
                progress(n)
        out.truncate(size)
        out.flush()
        os.fsync(out.fileno())


def stage(c: Container, dest: str, progress: Progress | None = None) -> dict:
    """Copy the container's expert files (and its streamed tables) into `dest` (made if missing), resuming what an
    earlier stage left; returns {"copied": [names], "kept": [names], "seconds": s}.
    Raises StageError (another container's directory, a damaged record in the container,
    a copy that reads back wrong) and OSError."""
    t0 = time.monotonic()
    os.makedirs(dest, exist_ok=True)
    state = _read_state(dest, c)
    copied, kept = [], []
    records, tables = expert_files(c), streamed_tables_file(c)
    for file in staged_files(c):
        name = os.path.basename(file)
        final, part = os.path.join(dest, name), os.path.join(dest, name + ".part")
        size = os.path.getsize(file)
        if state["files"].get(name) == "done" and os.path.exists(final) and os.path.getsize(final) == size:
            kept.append(name)
            if progress:
                progress(file_bytes(c, file))
            continue
        if tables and file == tables[0]:
            _copy_tables(c, file, part, progress)
        else:
            _copy(c, file, records[file], part, progress)
        problems = check_copy(c, file, part)
        if problems:
            raise StageError(f"{part} reads back wrong ({'; '.join(problems[:3])}): the drive may be failing")
        os.replace(part, final)
        dfd = os.open(dest, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
        state["files"][name] = "done"
        _write_state(dest, state)
        copied.append(name)
    return {"copied": copied, "kept": kept, "seconds": round(time.monotonic() - t0, 3)}


def _copy(c: Container, file: str, records: list[ExpertRecord], part: str, progress: Progress | None) -> None:
    """Copy `file` into `part` from where an earlier copy stopped (the end of its last
    whole record), checking each record against the manifest as it is read."""
    start = records[0].offset  # the bytes before the records: always copied again (small)
    have = os.path.getsize(part) if os.path.exists(part) else 0
    done = [r for r in records if r.offset + r.length <= have]
    resume = done[-1].offset + done[-1].length if done else start
    with open(file, "rb") as src, open(part, "r+b" if have else "wb") as out:
        out.truncate(resume)
        out.seek(0)
        out.write(src.read(start))
        if progress:
            progress(resume)
        rest = records[len(done):]
        per = max(1, CHUNK_BYTES // c.record_bytes)
        for i in range(0, len(rest), per):
            run = rest[i:i + per]
            src.seek(run[0].offset)
            data = src.read(run[-1].offset + run[-1].length - run[0].offset)
            for r in run:
                at = r.offset - run[0].offset
                if crc32(data[at:at + r.length]) != r.crc32:
                    raise StageError(f"{file}: layer {r.layer} expert {r.expert} does not match the manifest's "
                                     f"checksum: the container itself is damaged (colictl doctor --deep)")
            out.seek(run[0].offset)
            out.write(data)
            if progress:
                progress(len(data))
        src.seek(0, os.SEEK_END)
        tail = src.tell() - (records[-1].offset + records[-1].length)
        if tail:  # (nothing follows the last record in colibri's own files; kept for any that has)
            src.seek(records[-1].offset + records[-1].length)
            out.seek(records[-1].offset + records[-1].length)
            out.write(src.read(tail))
        out.flush()
        os.fsync(out.fileno())


def verify(c: Container, dest: str, progress: Progress | None = None) -> dict:
    """Check every copy in `dest` against the container: {"files": {name: "ok" | "missing"
    | [problems]}, "bad": count of files with problems}. A damaged copy is marked so that
    the next stage copies it again. Raises StageError when `dest` holds another
    container's copies."""
    state = _read_state(dest, c)
    report: dict = {}
    for file in staged_files(c):
        name = os.path.basename(file)
        copy = os.path.join(dest, name)
        if not os.path.exists(copy):
            report[name] = "missing"
            if progress:
                progress(file_bytes(c, file))
            continue
        problems = check_copy(c, file, copy, progress)
        report[name] = problems or "ok"
        if problems and state["files"].get(name) == "done":
            state["files"][name] = "damaged"
            _write_state(dest, state)
    return {"files": report, "bad": sum(isinstance(v, list) for v in report.values())}
