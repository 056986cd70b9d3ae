"""colibri's container: a checkpoint laid out for streaming experts from disk.

    DIR/colibri.json            the manifest (format version, source fingerprint,
                                precision per tensor class, the per-expert index)
    DIR/config.json, tokenizer files, generation_config.json   copied from the source
    DIR/dense.safetensors       every tensor that stays resident
    DIR/experts-LLLL.safetensors  one file per MoE layer

An expert file is valid safetensors. Its data section starts on a 4 KiB boundary and
holds one record per expert: the expert's gate, up and down matrices (and their
scales when quantized), each part 64-byte aligned inside the record, the record
starting on a 4 KiB boundary and padded to a multiple of 4 KiB, so one aligned
O_DIRECT read fetches one expert. Padding is named `__pad__.*` (U8 zeros) because
safetensors requires the tensors to cover the data section without gaps.
"""

import hashlib
import json
import os
from dataclasses import dataclass

import numpy as np

from .checkpoint import Checkpoint
from .checksum import crc32  # noqa: F401 (the records' checksum; cache, convert and doctor take it from here)
from .errors import CheckpointError, ConfigInvalid, DenseChecksumMismatch, read_json
from .formats import FORMATS
from .fpformats import quant_config
from .gguf import block_weight
from .quant import Expert, from_record
from .safetensors import DTYPES, SafetensorsFile

FORMAT = "colibri-container"
VERSION = 1
MANIFEST = "colibri.json"
DENSE_FILE = "dense.safetensors"
ALIGN = 4096  # record alignment: the O_DIRECT / page unit
PART_ALIGN = 64  # alignment of each part inside a record
PARTS = ("gate", "up", "down")
BIAS_PARTS = ("gate_bias", "up_bias", "down_bias")  # a family's expert biases (gpt-oss): 1-D, never quantized


class ContainerInvalid(CheckpointError):
    """The manifest is missing, of another version, or disagrees with the files."""


def is_container(path: str) -> bool:
    return os.path.isfile(os.path.join(path, MANIFEST))


def expert_file_name(il: int) -> str:
    return f"experts-{il:04d}.safetensors"


def round_up(n: int, align: int) -> int:
    return (n + align - 1) // align * align


@dataclass(frozen=True)
class RecordPart:
    part: str  # gate, up, down
    tensor: str  # "weight" (plain or quantized values) or "scales"
    dtype: str  # safetensors dtype name
    shape: tuple[int, ...]
    offset: int  # inside the record
    n_bytes: int
    ggml: str | None = None  # a GGUF file's block type (Q4_K, ...): `shape` is then [rows, row bytes] of U8 blocks

    def view(self, record: np.ndarray) -> np.ndarray:
        # record [record_bytes] uint8 -> this part, zero-copy
        return record[self.offset : self.offset + self.n_bytes].view(DTYPES[self.dtype]).reshape(self.shape)


def record_layout(parts: list[tuple]) -> tuple[list[RecordPart], int]:
    """Place (part, tensor, dtype, shape[, GGUF type]) entries in a record; return them and
    the record size."""
    out, offset = [], 0
    for part, tensor, dtype, shape, *gtype in parts:
        n = int(np.prod(shape)) * DTYPES[dtype].itemsize
        out.append(RecordPart(part, tensor, dtype, tuple(shape), offset, n, *gtype))
        offset = round_up(offset + n, PART_ALIGN)
    return out, round_up(max(offset, 1), ALIGN)


@dataclass(frozen=True)
class Extent:
    """A byte range of a record read from a file: `length` bytes at `offset` (both multiples
    of ALIGN) into the record's buffer at `at` (a multiple of ALIGN); the read may end at the
    file's end after `need` of them (the last tensor of a GGUF file)."""

    file: str  # absolute path
    offset: int
    length: int
    at: int
    need: int


@dataclass(frozen=True)
class ExpertRecord:
    layer: int
    expert: int
    file: str  # absolute path (the first extent's)
    offset: int  # absolute file offset, a multiple of ALIGN (the first extent's)
    length: int  # the bytes read: record_bytes for a container's record
    crc32: int | None  # None: nothing to check it against (a GGUF file's expert)
    extents: tuple[Extent, ...] = ()  # () for a container's one contiguous record; a GGUF expert's parts

    @property
    def spans(self) -> tuple[Extent, ...]:
        """The reads that fill the record's buffer."""
        return self.extents or (Extent(self.file, self.offset, self.length, 0, self.length),)


class Container:
    """An opened container. Raises ContainerInvalid, or the safetensors errors of its files."""

    views_per_record = False  # every record has the one layout (expert_views)
    extents = False  # every record is one contiguous read
    checksums = True  # every record has its crc32 in the manifest

    def __init__(self, path: str):
        self.path = path
        self.manifest = m = read_json(os.path.join(path, MANIFEST), ContainerInvalid)
        with open(os.path.join(path, MANIFEST), "rb") as f:  # the manifest names every record and its crc
            self.fingerprint = "sha256:" + hashlib.sha256(f.read()).hexdigest()[:32]
        if m.get("format") != FORMAT:
            raise ContainerInvalid(f"{path}/{MANIFEST}: not a colibri container manifest")
        if m.get("version") != VERSION:
            raise ContainerInvalid(
                f"{path}/{MANIFEST}: container version {m.get('version')!r}, this colibri reads version {VERSION}; "
                "convert the checkpoint again"
            )
        try:
            self.config = read_json(os.path.join(path, "config.json"))
        except FileNotFoundError:
            raise ConfigInvalid(f"{path}: container without config.json") from None
        dense_sums = m.get("dense")  # (containers written before the dense checksums have none)
        if dense_sums is not None:
            self.check_dense_header(dense_sums["header_crc32"])
        dense = SafetensorsFile(os.path.join(path, DENSE_FILE))
        self.dense = Checkpoint(path=path, config=self.config, files={DENSE_FILE: dense},
                                where=dict.fromkeys(dense.entries, DENSE_FILE),
                                quant=quant_config(self.config, os.path.join(path, "config.json")),
                                crc32={n: int(c) for n, c in dense_sums["tensors"].items()} if dense_sums else None,
                int_dense={n: (q["kind"], int(q["group_size"])) for q in [m["tensor_classes"]["dense"].get("int")]
                           if q for n in q["names"]} or None,
                ggml=m["tensor_classes"]["dense"].get("ggml"))
        self.dense_file = DENSE_FILE
        self.tables = m.get("tables", {})  # tensors of the dense file a model may stream by rows (storage/tables.py)
        ex = m["experts"]
        self.expert_dtype = m["tensor_classes"]["experts"]["dtype"]
        self.group_size = m["tensor_classes"]["experts"].get("group_size")
        self.block = m["tensor_classes"]["experts"].get("block")  # a published format's scale block [rows, columns] (None: per matrix)
        self.dense_dtype = m["tensor_classes"]["dense"]["dtype"]
        self.record_bytes = int(ex["record_bytes"])
        self.layout = record_parts(ex["layout"])
        # a GGUF file's experts kept as its blocks: each layer's own types (Q4_K_M's down
        # matrices are Q6_K in some layers, Q4_K in others), so each layer its own layout
        self.layouts = {int(il): record_parts(x) for il, x in ex.get("layouts", {}).items()}
        self.views_per_record = bool(self.layouts)
        self.n_expert = int(ex["n_expert"])
        self.records: dict[tuple[int, int], ExpertRecord] = {}
        files: dict[str, int] = {}
        for r in ex["index"]:
            file = os.path.join(path, r["file"])
            if os.path.basename(r["file"]) != r["file"]:
                raise ContainerInvalid(f"{path}/{MANIFEST}: index names a file outside the container: {r['file']!r}")
            if file not in files:
                try:
                    files[file] = os.path.getsize(file)
                except OSError:
                    raise ContainerInvalid(f"{file}: missing (listed in {MANIFEST})") from None
            if r["offset"] % ALIGN or r["length"] != self.record_bytes or r["offset"] + r["length"] > files[file]:
                raise ContainerInvalid(
                    f"{file}: record of layer {r['layer']} expert {r['expert']} at offset {r['offset']} "
                    f"(length {r['length']}) is misaligned or outside the file"
                )
            self.records[(r["layer"], r["expert"])] = ExpertRecord(
                r["layer"], r["expert"], file, r["offset"], r["length"], r["crc32"])
        self.moe_layers = sorted({il for il, _ in self.records})

    def check_dense_header(self, want: int) -> None:
        """The dense file's header (its length and JSON: every tensor's name, dtype, shape
        and place) against the manifest's crc32; its tensors are checked as they are read.
        Raises DenseChecksumMismatch."""
        file = os.path.join(self.path, DENSE_FILE)
        got = dense_header_crc(file)
        if got != want:
            raise DenseChecksumMismatch(f"{file}: its header fails its checksum (crc32 {got:08x}, the manifest says "
                                        f"{want:08x}): the file is damaged; restore it or convert the model again")

    def check_index(self, moe_layers: list[int], n_expert: int) -> None:
        """Every expert of the model's MoE layers indexed exactly once, no two records
        overlapping. Raises ContainerInvalid saying what is wrong."""
        want = {(il, ie) for il in moe_layers for ie in range(n_expert)}
        n_index = len(self.manifest["experts"]["index"])
        missing, extra = sorted(want - set(self.records)), sorted(set(self.records) - want)
        spans: dict = {}
        for rec in self.records.values():
            spans.setdefault(rec.file, []).append((rec.offset, rec.offset + rec.length))
        overlaps = 0
        for s in spans.values():
            s.sort()
            overlaps += sum(1 for a, b in zip(s, s[1:]) if b[0] < a[1])
        if missing or extra or overlaps or n_index != len(self.records):
            raise ContainerInvalid(f"{self.path}/{MANIFEST}: {len(missing)} experts missing (first: {missing[:3]}), "
                                   f"{len(extra)} not in the model, {n_index - len(self.records)} indexed twice, "
                                   f"{overlaps} overlapping records")

    def expert_views(self, record: np.ndarray, key: tuple[int, int] | None = None) -> tuple:
        """(gate, up, down), then the biases when the family has them, over one record's
        bytes, zero-copy: arrays in their storage dtype, or QuantWeight for quantized
        matrices (biases stay float), as an Expert. `key`, the expert's (layer, expert),
        matters where the layout is not every record's: a container keeping a GGUF file's
        blocks has one a layer (and storage/gguf_experts.py one an expert)."""
        layout = self.layouts[key[0]] if self.layouts else self.layout
        parts = {(p.part, p.tensor): block_weight(p.ggml, p.view(record)) if p.ggml else p.view(record) for p in layout}
        biases = tuple(parts[(n, "weight")] for n in BIAS_PARTS if (n, "weight") in parts)
        if self.expert_dtype in FORMATS and not self.layouts:  # block None: one scale per matrix (published formats)
            return Expert(tuple(from_record(self.expert_dtype, parts[(n, "weight")], parts[(n, "scales")], self.block)
                                for n in PARTS) + biases)
        return Expert(tuple(parts[(n, "weight")] for n in PARTS) + biases)

    @property
    def expert_bytes(self) -> int:
        return self.record_bytes * len(self.records)

    @property
    def dense_bytes(self) -> int:  # what stays resident (as GGUFExperts.dense_bytes for a GGUF file)
        return sum(sf.file_bytes for sf in self.dense.files.values())

    def precision(self) -> dict:
        """Precision per tensor class, the activations the experts compute on (as converted),
        and `lossy`: whether any of it differs from the source's."""
        src = self.manifest["source"].get("dtypes", {})
        lossy = self.expert_dtype != src.get("experts") or self.dense_dtype != src.get("dense")
        acts = self.manifest.get("activations", "float32")  # convert --activations
        q = self.manifest["tensor_classes"]["dense"].get("int")  # convert --dense-dtype int8/int4
        return {"dense": self.dense_dtype, "dense_fp8": self.manifest["tensor_classes"]["dense"].get("fp8"),
                "dense_int": f"{q['kind']} g{q['group_size']}" if q else None,
                "experts": self.expert_dtype, "group_size": self.group_size, "source": src,
                "lossy": bool(lossy or acts != "float32" or q), "activations": acts}


def record_parts(layout: list[dict]) -> list[RecordPart]:
    # a manifest's record layout
    return [RecordPart(p["part"], p["tensor"], p["dtype"], tuple(p["shape"]), p["offset"], p["bytes"], p.get("ggml"))
            for p in layout]


def dense_header_crc(file: str) -> int:
    """crc32 of a safetensors file's 8-byte length and header (0 for a file too short to
    have one: it then fails the check rather than raising here)."""
    with open(file, "rb") as f:
        head = f.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else 0
        return crc32(head + f.read(min(n, 1 << 26)))


def open_container(path: str) -> Container:
    """Open and check a container directory. Raises ContainerInvalid and storage errors."""
    try:
        return Container(path)
    except (KeyError, TypeError, ValueError) as e:
        raise ContainerInvalid(f"{path}/{MANIFEST}: malformed manifest ({type(e).__name__}: {e})") from None


def write_manifest(path: str, manifest: dict) -> None:
    with open(os.path.join(path, MANIFEST), "w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
