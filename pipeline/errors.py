"""Every error mxspec raises on purpose, in one place. Each carries the exit code the CLI turns it into and
the fields a caller needs to act on it without parsing the message (the path, repo, cell or log).

Messages are one line, say what is wrong and how to fix it, and never contain secrets. This module
imports nothing of mxspec's, so every layer can raise these.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["MxspecError", "BadInputError", "RecipeError", "NotSizedError", "GateFailedError", "ExternalError",
    "HubError", "ModelNotAvailableError", "ServerError", "CellFailedError", "EncoderMismatchError"]


class MxspecError(Exception):
    """Base class: an expected failure with a clear message. Exit 3 unless a subclass says otherwise."""

    exit_code = 3

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


class BadInputError(MxspecError):
    """The user gave something wrong: a recipe, a path, a checkpoint. Exit 2.
    `path`: the file or folder at fault, where there is one."""

    exit_code = 2

    def __init__(self, message: str, *, path: Path | str | None = None):
        super().__init__(message)
        self.path = Path(path) if path is not None else None


class RecipeError(BadInputError):
    """A recipe file does not parse or does not validate; `path` is the recipe."""


class NotSizedError(BadInputError):
    """mxspec cannot size this recipe's memory from configs (its target is not a Qwen3.5 one, or its config
    is not known here). `recipe check` shows the reason as a row; nothing else needs the plan."""


class GateFailedError(MxspecError):
    """The gate decided the result must not ship. Exit 1. `verdict`: the verdict file that says why."""

    exit_code = 1

    def __init__(self, message: str, *, verdict: Path | None = None):
        super().__init__(message)
        self.verdict = verdict


class ExternalError(MxspecError):
    """A component outside mxspec failed: the Hub, Quark, a vLLM server. Exit 3."""


class HubError(ExternalError):
    """The Hub refused a request or could not be reached. `repo_id` and `status` (the HTTP status, None
    when there was no answer) say which request."""

    def __init__(self, message: str, *, repo_id: str | None = None, status: int | None = None):
        super().__init__(message)
        self.repo_id = repo_id
        self.status = status


class ModelNotAvailableError(ExternalError):
    """The model is neither local nor in the Hub cache, and the Hub cannot be reached."""

    def __init__(self, message: str, *, role: str, repo_id: str, revision: str | None):
        super().__init__(message)
        self.role = role
        self.repo_id = repo_id
        self.revision = revision


class ServerError(ExternalError):
    """The vLLM server failed to start, died, or stopped answering. `log`: its log file, where known;
    `url`: the endpoint that failed, where one did."""

    def __init__(self, message: str, *, log: Path | None = None, url: str | None = None):
        super().__init__(message)
        self.log = log
        self.url = url


class CellFailedError(MxspecError):
    """A cell of the validation study could not be measured. `cell` names it and `log` is its log, where
    it has one; the exit code is the failure's own (3 for a server that died, 2 for bad input)."""

    def __init__(self, message: str, *, cell: str, log: Path | None = None, exit_code: int = 3):
        super().__init__(message)
        self.cell = cell
        self.log = log
        self.exit_code = exit_code


class EncoderMismatchError(ExternalError):
    """mxspec's MXFP4 kernel wrote other bytes than Quark's routine on some input, so it may not encode
    this run. `dtype` is the input dtype of the proof, `mismatches` how many inputs differed."""

    def __init__(self, message: str, *, dtype: str, mismatches: int):
        super().__init__(message)
        self.dtype = dtype
        self.mismatches = mismatches
