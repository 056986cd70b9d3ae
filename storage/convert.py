"""`colictl convert`: a Hugging Face checkpoint -> a colibri container (container.py).

The converter knows nothing of model families: the caller (ctl, through the engine)
says which tensors are routed experts with an ExpertPlan. Work happens one expert at
a time, so converting never holds more than the dense part and one expert in memory.
Everything is written into a temporary directory next to the destination and renamed
into place only when complete: an interrupted convert leaves nothing that opens.
"""

import hashlib
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from .checkpoint import Checkpoint
from .container import (
    ALIGN,
    BIAS_PARTS,
    DENSE_FILE,
    FORMAT,
    PARTS,
    VERSION,
    crc32,
    dense_header_crc,
    expert_file_name,
    record_layout,
    write_manifest,
)
from .errors import ColibriError
from .formats import FORMATS, PUBLISHED_DTYPES, QUANT_DTYPES, ggml
from .fpformats import FP8_DTYPES, scale_name
from .gguf import block_shape, kinds_label
from .quant import QuantWeight, check_group, dequantize, quantize, quantized_shapes
from .safetensors import SafetensorsWriter, bf16_to_f32, dtype_name, f32_to_bf16

FLOAT_DTYPES = ("bf16", "f16", "f32")
DENSE_GROUP = 32  # --dense-dtype int8/int4: one scale per 32 columns (Q8_0's and Q4_0's block)
ST_NAME = {"bf16": "BF16", "f16": "F16", "f32": "F32"}
OUR_NAME = {v: k for k, v in ST_NAME.items()}
CODE_DTYPES = {f.code_dtype for f in FORMATS.values()}  # how a record's codes are typed (read back as bytes)
COPIED = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
          "special_tokens_map.json", "chat_template.jinja")


class ConvertError(ColibriError):
    """The conversion cannot be done as asked (destination exists, bad group size, ...)."""


@dataclass
class ExpertPlan:
    moe_layers: list[int]
    n_expert: int
    names: Callable[[int, int], tuple[str, str, str]]  # (il, ie) -> gate, up, down tensor names
    dense: list[str] | None = None  # the other tensors the model reads (None: every other tensor)
    int_dense: list[str] | None = None  # the dense matrices an int8/int4 dense_dtype quantizes (MoEModel.int_dense_names)
    integer_experts: bool = True  # the family's experts can take int8 activations (MoEModel.CREW_EXPERTS)
    tables: list[str] | None = None  # dense tensors streamed by rows (MoEModel.table_names): their pages checksummed


def plan_for(model, **kw) -> ExpertPlan:
    """What convert writes of a model (engine/model.py MoEModel): its experts, its dense
    tensors, the matrices --dense-dtype may quantize, whether its experts take int8
    activations, the tables it may stream by rows; `kw` overrides."""
    return ExpertPlan(model.moe_layers, model.n_expert, model.expert_names, model.dense_names(),
                      **{"int_dense": model.int_dense_names(), "integer_experts": model.CREW_EXPERTS,
                         "tables": model.table_names()} | kw)


def table_checksums(tmp: str, names: list[str]) -> dict:
    """The tables a model streams by rows (storage/tables.py), as the dense file holds them:
    each one's bytes, shape, dtype and where its pages' crc32s start in tables.crc (written
    here, one per 4 KiB page of the dense file the table lies on)."""
    from .safetensors import SafetensorsFile
    from .tables import CRC_FILE, page_crcs

    if not names:
        return {}
    path = os.path.join(tmp, DENSE_FILE)
    dense, out, crcs = SafetensorsFile(path), {}, []
    for n in names:
        e = dense.entries[n]
        out[n] = {"begin": e.begin, "end": e.end, "shape": list(e.shape), "dtype": e.dtype,
                  "crc_index": sum(len(c) for c in crcs)}
        crcs.append(page_crcs(path, e.begin, e.end))
    np.concatenate(crcs).astype("<u4").tofile(os.path.join(tmp, CRC_FILE))
    return out


def fingerprint(ckpt: Checkpoint) -> str:
    """sha256 over config.json and every shard's name, size and header: cheap (no weight
    bytes are hashed) and changes whenever the checkpoint's contents are re-laid out."""
    h = hashlib.sha256()
    if os.path.isdir(ckpt.path):  # (a GGUF file: its metadata is in the headers hashed below)
        with open(os.path.join(ckpt.path, "config.json"), "rb") as f:
            h.update(f.read())
    for name in sorted(ckpt.files):
        sf = ckpt.files[name]
        h.update(f"{name}:{sf.file_bytes}".encode())
        with open(sf.path, "rb") as f:
            h.update(f.read(sf.data_begin))
    return "sha256:" + h.hexdigest()


def cast(a: np.ndarray, dtype: str | None) -> np.ndarray:
    """A storage-precision array (bf16 as uint16) in float dtype `dtype` (None keeps it)."""
    if dtype is None:
        return a
    f32 = bf16_to_f32(a) if a.dtype == np.uint16 else a.astype(np.float32)
    return {"bf16": f32_to_bf16, "f16": lambda x: x.astype(np.float16), "f32": lambda x: x}[dtype](f32)


def to_f32(a) -> np.ndarray:
    if isinstance(a, QuantWeight):  # a published format's values, exactly
        return dequantize(a)
    return bf16_to_f32(a) if a.dtype == np.uint16 else a.astype(np.float32)


def expert_values(src, name: str, expert_dtype: str | None, group_size: int | None) -> dict:
    """One expert matrix as the record stores it: {"weight"} or {"weight", "scales"}.
    A published format (FP8, MXFP4) is kept as its codes and scales; asked for another
    precision, its values are converted (lossy, and said so). A source may hand out
    matrices already quantized (`read_quantized`), as the benchmarks' synthetic models do."""
    if expert_dtype in PUBLISHED_DTYPES:
        qw = src.read_weight(name)
        if not isinstance(qw, QuantWeight) or qw.kind != expert_dtype:
            raise ConvertError(f"{name}: not {expert_dtype} in the checkpoint; colibri converts to "
                               f"{', '.join(FLOAT_DTYPES + QUANT_DTYPES)} only")
        return {"weight": qw.q, "scales": qw.scales}
    if expert_dtype not in QUANT_DTYPES:
        a = src.read_weight(name)  # a published format's values in float32 (exact), then cast as asked
        return {"weight": cast(dequantize(a) if isinstance(a, QuantWeight) else a, expert_dtype)}
    group = group_size or src.entry(name).shape[1]
    if hasattr(src, "read_quantized"):
        qw = src.read_quantized(name, expert_dtype, group)
    else:
        qw = quantize(to_f32(src.read_weight(name)), expert_dtype, group)
    return {"weight": qw.q, "scales": qw.scales}


def published_kind(src, plan: "ExpertPlan") -> QuantWeight | None:
    """The first expert's gate as read, when the checkpoint's experts are in a published
    format (its kind, block and shapes are every expert's), else None."""
    if not plan.moe_layers:
        return None
    w = src.read_weight(plan.names(plan.moe_layers[0], 0)[0])
    return w if isinstance(w, QuantWeight) else None


def convert(src: Checkpoint, dst: str, plan: ExpertPlan, expert_dtype: str | None = None,
            dense_dtype: str | None = None, group_size: int | None = None, force: bool = False,
            progress: Callable[[int, int], None] | None = None, order: dict | None = None,
            activations: str | None = None) -> dict:
    """Write the container for `src` at `dst`; return its manifest.

    expert_dtype: None (keep the checkpoint's), bf16, f16, f32, int8, int4; dense_dtype:
    None (keep), bf16, f16, f32. group_size: scale group for int8 (default: one per row)
    and int4 (default 64). order: {"layout": name, "source": fingerprint, "experts": {layer:
    [expert ids in record order]}} (storage/layout.py; None: id order). activations: what
    the container's experts compute on unless told otherwise, recorded in the manifest:
    "int8" (int8 and int4 experts only: the integer dot products, engine/formats/intdot.py),
    "float32", or None: int8 for int8 and int4 experts whose rows and groups are whole
    blocks of 32 (it adds ~1-4 % to int4's KL divergence and is up to 4x faster:
    docs/benchmarks.md), else float32. Raises ConvertError
    (dst exists without force, a group size that does not divide a matrix), the
    checkpoint's errors, OSError.
    """
    dst = os.path.abspath(dst)
    if os.path.exists(dst) and not force:
        raise ConvertError(f"{dst} exists; choose another destination or pass --force to replace it")
    if expert_dtype in PUBLISHED_DTYPES:
        raise ConvertError(f"--dtype {expert_dtype}: colibri keeps a checkpoint's {expert_dtype} as it is "
                           "(the default) but does not quantize to it")
    blocks = sorted({t.dtype for t in getattr(src, "tensors", {}).values() if t.dtype in ggml.BY_TYPE_NAME})
    if blocks and (expert_dtype or dense_dtype or group_size or activations == "int8"):
        raise ConvertError(f"{src.path}: a GGUF file's {', '.join(blocks)} blocks are kept as stored; --dtype, "
                           "--dense-dtype, --group-size and --activations int8 do not apply to it")
    published = None if blocks else published_kind(src, plan)
    if expert_dtype is None and published is not None:
        expert_dtype = published.kind  # kept as published
    quant = expert_dtype in QUANT_DTYPES
    if activations not in (None, "float32", "int8"):
        raise ConvertError(f"activations {activations!r}: float32 or int8")
    if activations == "int8" and expert_dtype not in ("int8", "int4"):
        raise ConvertError("--activations int8 computes on int8 or int4 experts: add --dtype int4 or int8")
    gate0 = src.entry(plan.names(plan.moe_layers[0], 0)[0]) if plan.moe_layers else None
    # the three matrices' shapes, then the biases' when the family has them (gpt-oss)
    shapes = [src.entry(n).shape for n in plan.names(plan.moe_layers[0], 0)] if plan.moe_layers else []
    if quant:
        group_size = group_size or FORMATS[expert_dtype].default_group
        for part, shape in zip(PARTS, shapes):
            why = check_group(expert_dtype, shape, group_size or shape[1])
            if why:
                raise ConvertError(f"cannot quantize {part} [{shape[0]}, {shape[1]}] to {expert_dtype}: {why}")
    # int8 activations compute on whole tiles of 16 rows and blocks of 32 columns (engine/formats/intdot.py)
    whole = all(shape[0] % 16 == 0 and shape[1] % 32 == 0 and (group_size or shape[1]) % 32 == 0
                for shape in shapes[:3])
    if activations == "int8" and not whole:
        raise ConvertError(f"--activations int8 takes matrices of whole tiles of 16 rows and blocks of 32 columns "
                           f"(and groups): the experts' are {sorted({tuple(shape) for shape in shapes[:3]})} "
                           f"(group {group_size or 'a row'})")
    if activations == "int8" and not plan.integer_experts:
        raise ConvertError("--activations int8: this family's experts are not computed by the integer kernels")
    if dense_dtype in QUANT_DTYPES:
        if not plan.int_dense:
            raise ConvertError(f"--dense-dtype {dense_dtype}: this family's dense matrices are not computed in "
                               f"{dense_dtype} yet (bf16, f16 or f32)")
        for n in plan.int_dense:
            why = check_group(dense_dtype, src.entry(n).shape, DENSE_GROUP)
            if why or src.entry(n).shape[1] % 32:
                raise ConvertError(f"cannot quantize {n} {list(src.entry(n).shape)} to {dense_dtype}: "
                                   f"{why or 'rows must be whole blocks of 32'}")
    if activations is None:
        activations = "int8" if (expert_dtype in ("int8", "int4") and whole and plan.integer_experts) \
            or dense_dtype in QUANT_DTYPES else "float32"
    parent = os.path.dirname(dst)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(dst)}.converting-", dir=parent)
    try:
        manifest = _write(src, tmp, plan, expert_dtype, dense_dtype, group_size, shapes, gate0, published, progress,
                          order, bool(blocks))
        manifest["activations"] = activations
        write_manifest(tmp, manifest)
        if os.path.exists(dst):
            old = tempfile.mkdtemp(prefix=f".{os.path.basename(dst)}.old-", dir=parent)
            os.rename(dst, os.path.join(old, "x"))
            os.rename(tmp, dst)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return manifest


def expert_file_entries(il: int, plan: ExpertPlan, layout, record_bytes: int, quant: bool,
                        order: list[int] | None = None) -> list:
    """The safetensors entries of layer il's expert file, its records in `order` (None: id
    order): each record's parts under the checkpoint's names (`.qweight`/`.scales` when
    `quant`: values and scales, colibri's int8/int4 or a published format), with `__pad__.*`
    U8 tensors filling the alignment gaps, since safetensors allows no holes."""
    entries = []
    for ie in order or range(plan.n_expert):
        names, cursor = plan.names(il, ie), 0
        for p in layout:
            if p.offset > cursor:
                entries.append((f"__pad__.{il}.{ie}.{p.part}.{p.tensor}", "U8", (p.offset - cursor,)))
            name = names[(PARTS + BIAS_PARTS).index(p.part)]
            if quant and p.part in PARTS:
                name = f"{name.removesuffix('.weight')}.{'qweight' if p.tensor == 'weight' else 'scales'}"
            entries.append((name, p.dtype, p.shape))
            cursor = p.offset + p.n_bytes
        if record_bytes > cursor:
            entries.append((f"__pad__.{il}.{ie}.tail", "U8", (record_bytes - cursor,)))
    return entries


def layout_json(layout) -> list[dict]:
    return [{"part": p.part, "tensor": p.tensor, "dtype": p.dtype, "shape": list(p.shape), "offset": p.offset,
             "bytes": p.n_bytes, **({"ggml": p.ggml} if p.ggml else {})} for p in layout]


def _write(src, tmp, plan, expert_dtype, dense_dtype, group_size, shapes, gate0, published, progress,
           order=None, blocks=False) -> dict:
    t0 = time.perf_counter()
    for name in COPIED:
        if os.path.isfile(os.path.join(src.path, name)):
            shutil.copyfile(os.path.join(src.path, name), os.path.join(tmp, name))
    for name, text in (src.files_for_container() if hasattr(src, "files_for_container") else {}).items():
        with open(os.path.join(tmp, name), "w", encoding="utf-8") as f:  # a GGUF file's config and tokenizer
            f.write(text)

    expert_names = {n for il in plan.moe_layers for ie in range(plan.n_expert) for n in plan.names(il, ie)}
    wanted = set(plan.dense) if plan.dense is not None else set(src.where)
    # an FP8 matrix's scales go with it, as they are (never cast)
    scales = {scale_name(n, src) for n in wanted if n in src.where and src.entry(n).dtype in FP8_DTYPES}
    wanted |= scales
    dense_names = sorted(n for n in src.where if n not in expert_names and n in wanted)
    if dense_dtype is None and expert_dtype in FLOAT_DTYPES:
        dense_dtype = expert_dtype  # --dtype bf16/f16/f32 means the whole model
    total = len(dense_names) + len(plan.moe_layers) * plan.n_expert
    done = 0

    entries = []
    # --dense-dtype int8/int4: the matrices the family computes by linear() (plan.int_dense) in
    # that format, each stored under its own name with its scales beside it (NAME.scales);
    # the rest (norms, embeddings, routers) keeps its precision
    qdense = {n for n in plan.int_dense or () if n in dense_names and src.entry(n).dtype in OUR_NAME} \
        if dense_dtype in QUANT_DTYPES else set()
    float_dtype = dense_dtype if dense_dtype in FLOAT_DTYPES else None
    recast = {n for n in dense_names if float_dtype and src.entry(n).dtype in OUR_NAME and n not in scales}
    # a GGUF file's matrices in block formats: their blocks as stored, U8 [rows, row bytes]
    # under their names, each one's GGUF type in the manifest
    ggml_dense = {n: src.entry(n).dtype for n in dense_names if src.entry(n).dtype in ggml.BY_TYPE_NAME}
    for n in dense_names:
        e = src.entry(n)
        if n in ggml_dense:
            entries.append((n, "U8", block_shape(e.dtype, e.shape)))
            continue
        if n in qdense:
            qshape, sshape = quantized_shapes(dense_dtype, e.shape, DENSE_GROUP)
            entries += [(n, FORMATS[dense_dtype].code_dtype, qshape), (n + ".scales", "F16", sshape)]
            continue
        entries.append((n, ST_NAME[float_dtype] if n in recast else e.dtype, e.shape))
    w = SafetensorsWriter(os.path.join(tmp, DENSE_FILE), entries, {"format": "pt", "colibri": "dense"})
    dense_crc = {}  # every byte of the dense file is checksummed: its header, and each tensor
    for n in dense_names:
        a = src.read(n)
        if n in qdense:
            qw = quantize(to_f32(a), dense_dtype, DENSE_GROUP)
            parts = [(n, qw.q), (n + ".scales", qw.scales)]
        else:
            parts = [(n, cast(a, float_dtype) if n in recast else a)]
        for name, arr in parts:
            data = np.ascontiguousarray(arr).reshape(-1).view(np.uint8)
            dense_crc[name] = crc32(data)
            w.write(data)
        done += 1
        if progress:
            progress(done, total)
    w.close()
    dense_sums = {"file": DENSE_FILE, "checksum": "crc32",
                  "header_crc32": dense_header_crc(os.path.join(tmp, DENSE_FILE)), "tensors": dense_crc}
    tables = table_checksums(tmp, [n for n in plan.tables or () if n in dense_names])

    block, parts = None, []  # a published format's scale block: [rows, columns]; one record's parts
    if blocks:  # (below: a layout a layer)
        quant = False
    elif quant := expert_dtype in ("int8", "int4"):
        for part, shape in zip(PARTS, shapes):
            g = group_size or shape[1]
            qshape, sshape = quantized_shapes(expert_dtype, shape, g)
            parts += [(part, "weight", FORMATS[expert_dtype].code_dtype, qshape), (part, "scales", "F16", sshape)]
    elif quant := expert_dtype in PUBLISHED_DTYPES:  # as the checkpoint has them: codes, then scales
        first = [src.read_weight(n) for n in plan.names(plan.moe_layers[0], 0)[:len(PARTS)]]
        code_dtype = FORMATS[expert_dtype].code_dtype
        for part, qw in zip(PARTS, first):
            parts += [(part, "weight", code_dtype, qw.q.shape), (part, "scales", dtype_name(qw.scales), qw.scales.shape)]
        qc = src.quant  # FP8's scale block; None: one scale per matrix
        block = [1, published.group_size] if expert_dtype == "mxfp4" else list(qc.block) if qc.block else None
    else:
        keep = ST_NAME[expert_dtype] if expert_dtype else (gate0.dtype if gate0 else "BF16")
        parts = [(part, "weight", keep, shape) for part, shape in zip(PARTS, shapes)]
    bias_src = src.entry(plan.names(plan.moe_layers[0], 0)[len(PARTS)]).dtype if len(shapes) > len(PARTS) else None
    bias_dtype = ST_NAME[expert_dtype] if expert_dtype in FLOAT_DTYPES else (bias_src or "BF16")
    layouts = {}  # a GGUF file's experts: each layer's own types as stored (Q4_K_M mixes them by layer)
    if not blocks:
        parts += [(part, "weight", bias_dtype, shape) for part, shape in zip(BIAS_PARTS, shapes[3:])]
        layout, record_bytes = record_layout(parts)
    else:
        sized = {il: record_layout([(part, "weight", "U8", block_shape(e.dtype, e.shape), e.dtype)
                                    if e.dtype in ggml.BY_TYPE_NAME else (part, "weight", e.dtype, e.shape)
                                    for part, e in zip(PARTS + BIAS_PARTS, map(src.entry, plan.names(il, 0)))])
                 for il in plan.moe_layers}
        layouts = {il: x for il, (x, _) in sized.items()}
        record_bytes = max(n for _, n in sized.values())  # every record the largest layer's size
        layout = layouts[plan.moe_layers[0]]
        expert_dtype = kinds_label({src.entry(n).dtype for il in plan.moe_layers for n in plan.names(il, 0)})

    index = []
    for il in plan.moe_layers:
        file = expert_file_name(il)
        meta = {"format": "pt", "colibri": "experts", "layer": str(il), "record_bytes": str(record_bytes)}
        ids = order["experts"][il] if order else list(range(plan.n_expert))
        lay = layouts.get(il, layout)
        entries = expert_file_entries(il, plan, lay, record_bytes, quant, ids)
        w = SafetensorsWriter(os.path.join(tmp, file), entries, meta, header_align=ALIGN)
        record = np.zeros(record_bytes, np.uint8)
        for pos, ie in enumerate(ids):
            record[:] = 0
            for part, name in zip(PARTS + BIAS_PARTS, plan.names(il, ie)):
                if blocks:  # as stored
                    values = {"weight": src.read(name)}
                elif part in BIAS_PARTS:  # never quantized: the float dtype the record keeps them in
                    values = {"weight": cast(src.read(name), OUR_NAME[bias_dtype])}
                else:
                    values = expert_values(src, name, expert_dtype, group_size)
                for p in lay:
                    if p.part == part:
                        v = np.ascontiguousarray(values[p.tensor])
                        assert dtype_name(v) == p.dtype or p.dtype in CODE_DTYPES
                        record[p.offset : p.offset + p.n_bytes] = v.reshape(-1).view(np.uint8)
            w.write(record)
            index.append({"layer": il, "expert": ie, "file": file, "offset": w.data_begin + pos * record_bytes,
                          "length": record_bytes, "crc32": crc32(record)})
            done += 1
            if progress:
                progress(done, total)
        w.close()

    src_dense = next((src.entry(n).dtype for n in dense_names if src.entry(n).dtype in OUR_NAME and n not in scales), "BF16")
    fp8_dense = sorted({FP8_DTYPES[src.entry(n).dtype] for n in dense_names if src.entry(n).dtype in FP8_DTYPES})
    src_experts = published.kind if published is not None else expert_dtype if blocks else \
        OUR_NAME.get(gate0.dtype if gate0 else "BF16")
    if ggml_dense:  # (named as a GGUF file's precision is: its block formats, q4_k+q6_k+q8_0)
        src_dense = float_dtype = kinds_label(set(ggml_dense.values()))
    manifest = {
        "format": FORMAT,
        "version": VERSION,
        "source": {"path": os.path.abspath(src.path), "fingerprint": fingerprint(src),
                   "dtypes": {"dense": OUR_NAME.get(src_dense, src_dense), "experts": src_experts}},
        "model_type": src.config.get("model_type"),
        "tensor_classes": {
            # its FP8 matrices (with their scales) are kept as published whatever dtype the rest has
            "dense": {"dtype": float_dtype or OUR_NAME[src_dense], **({"fp8": fp8_dense} if fp8_dense else {}),
                      **({"ggml": ggml_dense} if ggml_dense else {}),
                      **({"int": {"kind": dense_dtype, "group_size": DENSE_GROUP, "names": sorted(qdense)}}
                         if qdense else {})},
            "experts": {"dtype": expert_dtype or src_experts,
                        "group_size": block[1] if block else None if published else group_size if quant else None,
                        **({"block": block} if published else {})},
        },
        "dense": dense_sums,
        **({"tables": tables} if tables else {}),
        "experts": {
            "n_layer": len(plan.moe_layers),
            "n_expert": plan.n_expert,
            "record_bytes": record_bytes,
            "align": ALIGN,
            "checksum": "crc32",
            "order": {"layout": order["layout"], "source": order["source"]} if order else {"layout": "expert id"},
            "layout": layout_json(layout),
            **({"layouts": {str(il): layout_json(x) for il, x in layouts.items()}} if layouts else {}),
            "index": index,
        },
        "convert_s": round(time.perf_counter() - t0, 3),
    }
    write_manifest(tmp, manifest)
    return manifest
