"""Typed errors. Each carries the process exit code the CLI turns it into.

Messages are one line, say what is wrong and how to fix it, and never contain secrets.
"""


class MxspecError(Exception):
    """Base class: an expected failure with a clear message."""

    exit_code = 3


class BadInputError(MxspecError):
    """The user gave something wrong: a recipe, a path, a checkpoint. Exit 2."""

    exit_code = 2


class RecipeError(BadInputError):
    """A recipe file does not parse or does not validate."""


class GateFailedError(MxspecError):
    """The gate decided the result must not ship. Exit 1."""

    exit_code = 1


class ExternalError(MxspecError):
    """A component outside mxspec failed: the Hub, Quark, a vLLM server. Exit 3."""

    exit_code = 3
