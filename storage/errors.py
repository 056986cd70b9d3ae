"""Named errors for everything that can be wrong with a model on disk, and the strict
JSON reader that raises them (every floor reads a model directory's JSON files with it).

One class per way a checkpoint can be wrong, so callers (and tests) can tell them
apart; every message names the file and, where there is one, the tensor. The
command line maps the base class to one exit code and prints the message alone.
"""

import json


class ColibriError(Exception):
    """Base of every error colibri reports to a user as one line."""


class CheckpointError(ColibriError):
    """A model directory or file that cannot be used."""


class ModelNotFound(CheckpointError):
    """The model path does not exist or is not a directory."""


class ConfigMissing(CheckpointError):
    """The model directory has no config.json."""


class ConfigInvalid(CheckpointError):
    """config.json is not valid JSON or a field has a wrong type or value."""


class UnsupportedModelType(CheckpointError):
    """config.json names a model_type no family file implements."""


class PickleCheckpointRefused(CheckpointError):
    """Only .bin/.pt weights were found; colibri never unpickles."""


class WeightsMissing(CheckpointError):
    """No safetensors file or index in the model directory."""


class IndexInvalid(CheckpointError):
    """model.safetensors.index.json is malformed or points at a missing shard or tensor."""


class HeaderTooSmall(CheckpointError):
    """The file is shorter than the 8-byte header length prefix."""


class HeaderTruncated(CheckpointError):
    """The header length prefix points past the end of the file, or is absurdly large."""


class HeaderInvalid(CheckpointError):
    """The header is not UTF-8 JSON of the safetensors shape (a dict of tensor entries)."""


class UnsupportedDtype(CheckpointError):
    """A tensor has a dtype colibri does not compute with (bf16, f16, f32, and FP8 or MXFP4
    with their scales)."""


class TensorOutOfBounds(CheckpointError):
    """A tensor's data_offsets point outside the file's data section."""


class TensorOverlap(CheckpointError):
    """Two tensors' byte ranges overlap."""


class TensorSizeMismatch(CheckpointError):
    """dtype size x product(shape) is not the tensor's byte length."""


class TensorMissing(CheckpointError):
    """A tensor the model family needs is not in the checkpoint."""


class TensorShapeMismatch(CheckpointError):
    """A tensor's shape is not the one the config implies."""


class QuantizationUnsupported(CheckpointError):
    """The checkpoint is quantized by a method (or in a format) colibri does not compute on;
    the message names it and the ones colibri reads (FP8 block-scaled, MXFP4)."""


class ScalesMismatch(CheckpointError):
    """A quantized weight's scales are missing, of a wrong dtype, or not shaped as the
    weight's blocks."""


class NonFiniteWeights(CheckpointError):
    """A quantized weight holds NaN or infinity codes: the checkpoint is damaged."""


class DenseChecksumMismatch(CheckpointError):
    """A container's dense file disagrees with the manifest's checksum (names the tensor)."""


class GGUFInvalid(CheckpointError):
    """A GGUF file that is malformed or truncated, or a split set with a part missing."""


class ArchitectureUnsupported(CheckpointError):
    """A GGUF file of an architecture colibri does not map to a family (or of options it
    does not read yet)."""


class TokenizerUnsupported(CheckpointError):
    """A GGUF file without a tokenizer, or with one colibri does not build."""


class BudgetInvalid(ColibriError):
    """An expert budget that cannot be parsed, or is too small to run the model."""


class ExpertReadError(ColibriError):
    """Reading an expert record from disk failed (after the retry and the other drives): the
    message names the layer, the expert, the file and the offset."""


def read_json(path: str, error=None) -> dict:
    """Load a JSON object from path; raise `error` (default ConfigInvalid) naming the file if
    it is not one."""
    error = error or ConfigInvalid
    try:
        with open(path, encoding="utf-8") as f:
            obj = json.load(f)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise error(f"{path}: not valid JSON ({e})") from None
    if not isinstance(obj, dict):
        raise error(f"{path}: expected a JSON object, found {type(obj).__name__}")
    return obj
