"""The error tree: every failure a user can cause is a `NextokenError` naming the bad value.

The CLI turns these into one line on stderr and exit code 2; the server maps them to HTTP status codes
(`http_status`). Anything else escaping is a bug in nextoken, not a user error.
"""

from __future__ import annotations


class NextokenError(Exception):
    """Base of every error nextoken raises on purpose."""

    http_status: int = 400


class ModelLoadError(NextokenError):
    """A model file that cannot be read: names the file and what is wrong with it."""

    def __init__(self, path: object, reason: str) -> None:
        self.path = str(path)
        self.reason = reason
        super().__init__(f"cannot load model file {self.path}: {reason}")


class UnknownModel(NextokenError):
    """A model name that is neither registered nor a path to a .gguf file or a model directory."""

    http_status = 404


class ModelNotInstalled(NextokenError):
    """A registered model whose package is missing; the message names the command that installs it."""

    http_status = 404


class TokenizerError(NextokenError):
    """Tokenizer metadata that cannot build a tokenizer, or ids outside the vocabulary."""


class TemplateError(NextokenError):
    """A chat template that fails to render: a syntax error, `raise_exception`, a sandbox or limit violation."""


class InvalidInput(NextokenError):
    """A prompt, or a request field checked against the model, that it cannot take: an empty prompt, token ids
    outside the vocabulary. `param` names the request field at fault where the caller has one (the server's 400)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class PromptTooLong(InvalidInput):
    """A prompt (plus the tokens asked for) that does not fit the model's context."""


class InvalidSamplingParams(NextokenError):
    """A sampling parameter outside its valid range; names the parameter."""
