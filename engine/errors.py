"""Named errors of the engine (the storage errors live in storage/errors.py)."""

from ..storage.errors import CheckpointError, ColibriError


class InvalidRequest(ColibriError):
    """A request the engine cannot run as asked: bad sampling values, an empty prompt."""


class PromptTooLong(InvalidRequest):
    """The prompt has more tokens than the model's context."""


class TokenizerMissing(CheckpointError):
    """The model directory has no usable tokenizer.json."""


class ChatTemplateError(CheckpointError):
    """The model has no chat_template, or it failed to render."""


class ActivationsUnsupported(CheckpointError):
    """`activations: int8` was asked of a model whose routed experts are not int8 or int4
    (the integer path has nothing to compute on: `colictl convert --dtype int4` makes them so)."""
