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
