"""A Hugging Face checkpoint directory: config.json, safetensors shards, index.

Opening indexes every tensor of every shard and checks each file (see
safetensors.SafetensorsFile) before any weight is read. Families then ask for each
tensor they need with `expect`, which checks presence, dtype and shape.
"""

import os
from dataclasses import dataclass

import numpy as np

from .checksum import crc32
from .errors import (
    ConfigMissing,
    DenseChecksumMismatch,
    IndexInvalid,
    ModelNotFound,
    PickleCheckpointRefused,
    TensorMissing,
    TensorShapeMismatch,
    UnsupportedDtype,
    WeightsMissing,
    read_json,
)
from .formats import FORMATS
from .fpformats import FP8_DTYPES, QuantConfig, check_fp4, check_fp8, quant_config, read_fp4, read_fp8
from .gguf import GGUFCheckpoint, block_shape, block_weight, is_gguf
from .quant import QuantWeight, quantized_shapes
from .safetensors import WEIGHT_DTYPES, SafetensorsFile, TensorEntry

INTEGER_DTYPES = ("I32", "I64")

INDEX_NAME = "model.safetensors.index.json"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


@dataclass
class Checkpoint:
    """An opened checkpoint: its config and an index of every tensor."""

    path: str
    config: dict
    files: dict[str, SafetensorsFile]  # file name -> opened file
    where: dict[str, str]  # tensor name -> file name
    quant: QuantConfig | None = None  # how its quantized weights are scaled (fpformats)
    crc32: dict[str, int] | None = None  # tensor name -> crc32 of its bytes (a container's dense file), checked on read
    int_dense: dict | None = None  # name -> (kind, group): a container's int8/int4 dense matrices (scales at NAME.scales)
    ggml: dict | None = None  # name -> GGUF type: a container's dense matrices kept in a GGUF file's blocks (U8)

    def has(self, name: str) -> bool:
        return name in self.where

    def entry(self, name: str) -> TensorEntry:
        """The header entry of a tensor; raises TensorMissing."""
        f = self.where.get(name)
        if f is None:
            raise TensorMissing(f"{self.path}: tensor {name!r} is missing")
        return self.files[f].entries[name]

    def expect(self, name: str, shape: tuple[int, ...], integer: bool = False) -> TensorEntry:
        """Check that a weight exists with the given shape and a weight dtype (`integer`: an
        integer table, such as DeepSeek-V4's token -> expert map).

        Raises TensorMissing, TensorShapeMismatch or UnsupportedDtype, naming file and tensor.
        """
        e = self.entry(name)
        file = self.files[self.where[name]].path
        if self.int_dense and name in self.int_dense:  # colibri's own int8/int4, with its scales
            kind, g = self.int_dense[name]
            qshape, sshape = quantized_shapes(kind, tuple(shape), g)
            s = self.entry(name + ".scales")
            if e.shape != qshape or e.dtype != FORMATS[kind].code_dtype or s.shape != sshape or s.dtype != "F16":
                raise TensorShapeMismatch(f"{file}: tensor {name!r} is {e.dtype} {list(e.shape)} with scales "
                                          f"{s.dtype} {list(s.shape)}; {kind} g{g} of {list(shape)} is "
                                          f"{FORMATS[kind].code_dtype} {list(qshape)} with F16 {list(sshape)}")
            return e
        if self.ggml and name in self.ggml:  # a GGUF file's blocks, as stored
            want = block_shape(self.ggml[name], tuple(shape))
            if e.dtype != "U8" or e.shape != want or len(shape) != 2:
                raise TensorShapeMismatch(f"{file}: tensor {name!r} is {e.dtype} {list(e.shape)}; {self.ggml[name]} "
                                          f"blocks of {list(shape)} are U8 {list(want)}")
            return e
        if e.dtype == "I8" and not integer and len(shape) == 2:  # FP4 experts: half the columns (fpformats)
            check_fp4(self, name, e, tuple(shape))
            return e
        if e.shape != tuple(shape):
            raise TensorShapeMismatch(
                f"{file}: tensor {name!r} has shape {list(e.shape)}, config implies {list(shape)}"
            )
        if integer:
            if e.dtype not in INTEGER_DTYPES:
                raise UnsupportedDtype(f"{file}: tensor {name!r} is {e.dtype}; an integer table must be I32 or I64")
        elif e.dtype in FP8_DTYPES:
            check_fp8(self, name, e)
        elif e.dtype not in WEIGHT_DTYPES:
            raise UnsupportedDtype(f"{file}: tensor {name!r} is {e.dtype}; weights must be BF16, F16, F32, "
                                   "or FP8 with block scales")
        return e

    def read(self, name: str) -> np.ndarray:
        """Read a tensor in its storage dtype (bf16 as uint16), checked against its crc32
        where the checkpoint has one. Raises TensorMissing, DenseChecksumMismatch, OSError."""
        self.entry(name)
        a = self.files[self.where[name]].read(name)
        if self.crc32 is not None:
            want, got = self.crc32.get(name), crc32(a.reshape(-1).view(np.uint8))
            if want != got:
                raise DenseChecksumMismatch(
                    f"{self.file_of(name)}: tensor {name!r} " + (f"fails its checksum (crc32 {got:08x}, the manifest "
                                                                 f"says {want:08x})" if want is not None else
                                                                 "has no checksum in the manifest")
                    + ": the file is damaged; restore it or convert the model again")
        return a

    def read_weight(self, name: str) -> "np.ndarray | QuantWeight":
        """A weight as colibri computes on it: an array in its storage dtype, or for an FP8
        tensor a QuantWeight of its codes and scales (fpformats.read_fp8). Raises
        TensorMissing, ScalesMismatch, NonFiniteWeights, OSError."""
        dtype = self.entry(name).dtype
        if self.int_dense and name in self.int_dense:
            kind, g = self.int_dense[name]
            return QuantWeight(kind, self.read(name), self.read(name + ".scales"), g)
        if self.ggml and name in self.ggml:
            return block_weight(self.ggml[name], self.read(name))
        if dtype in FP8_DTYPES:
            return read_fp8(self, name)
        if dtype == "I8" and self.quant is not None and self.quant.fp4_experts:
            return read_fp4(self, name)
        return self.read(name)

    def file_of(self, name: str) -> str:
        return self.files[self.where[name]].path


def load_config(path: str) -> dict:
    """Read config.json of a model directory (a GGUF file: its metadata as the family's
    config, storage/gguf.py). Raises ModelNotFound, ConfigMissing, ConfigInvalid, and for a
    GGUF file what GGUFCheckpoint raises."""
    if is_gguf(path):
        return GGUFCheckpoint(path).config
    if not os.path.exists(path):
        raise ModelNotFound(f"{path}: no such model directory")
    if not os.path.isdir(path):
        raise ModelNotFound(f"{path}: not a directory (a model is a directory with config.json)")
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise ConfigMissing(f"{path}: no config.json (is this a Hugging Face model directory?)")
    return read_json(cfg_path)


def open_checkpoint(path: str) -> "Checkpoint | GGUFCheckpoint":
    """Open a Hugging Face checkpoint directory and index all its tensors.

    Raises ModelNotFound, ConfigMissing, ConfigInvalid, QuantizationUnsupported,
    PickleCheckpointRefused, WeightsMissing, IndexInvalid, or any safetensors header error
    of a shard. A GGUF file (or split set) opens as a GGUFCheckpoint (storage/gguf.py).
    """
    if is_gguf(path):
        return GGUFCheckpoint(path)
    config = load_config(path)
    quant = quant_config(config, os.path.join(path, "config.json"))
    names = sorted(os.listdir(path))
    index_path = os.path.join(path, INDEX_NAME)
    if os.path.isfile(index_path):
        index = read_json(index_path, IndexInvalid)
        weight_map = index.get("weight_map")
        if not isinstance(weight_map, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
        ):
            raise IndexInvalid(f"{index_path}: weight_map must map tensor names to shard file names")
        shard_names = sorted(set(weight_map.values()))
    else:
        weight_map = None
        shard_names = [n for n in names if n.endswith(".safetensors")]
    if not shard_names:
        pickles = [n for n in names if n.endswith(PICKLE_SUFFIXES)]
        if pickles:
            raise PickleCheckpointRefused(
                f"{path}: only pickle weights ({', '.join(pickles[:3])}); colibri never unpickles. "
                "Convert them to safetensors first (e.g. with transformers: "
                "model.save_pretrained(dir, safe_serialization=True))"
            )
        raise WeightsMissing(f"{path}: no *.safetensors file and no {INDEX_NAME}")

    files: dict[str, SafetensorsFile] = {}
    for shard in shard_names:
        shard_path = os.path.join(path, shard)
        if os.path.basename(shard) != shard or not os.path.isfile(shard_path):
            raise IndexInvalid(f"{index_path}: shard {shard!r} is not a file in {path}")
        files[shard] = SafetensorsFile(shard_path)

    where: dict[str, str] = {}
    if weight_map is not None:
        for name, shard in weight_map.items():
            if name not in files[shard].entries:
                raise IndexInvalid(f"{index_path}: tensor {name!r} is mapped to {shard}, which does not hold it")
            where[name] = shard
    else:
        for shard, f in files.items():
            for name in f.entries:
                if name in where:
                    raise IndexInvalid(f"{path}: tensor {name!r} appears in both {where[name]} and {shard}")
                where[name] = shard
    return Checkpoint(path=path, config=config, files=files, where=where, quant=quant)
