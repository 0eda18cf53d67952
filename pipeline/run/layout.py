"""The run folder: where every stage's outputs live, named once.

    OUT/.mxspec/                 mxspec's own state: the run lock, the hash cache, logs/<stage>.log,
                                 logs/servers/<server>.log, and cells/<cell>/ (validate's finished cells)
    OUT/<stage>/manifest.json    what the stage's outputs were made from (see `runner`)
    OUT/resolve/<role>.json      each model's local folder and file hashes
    OUT/quantize/checkpoint/     the MXFP4 checkpoint, and mxspec-quantize.json beside it
    OUT/pair/pair.json           the drafter/target pairing and the launch commands
    OUT/validate/report.json     the measurements, report.md and the figures beside it, cells/ (links)
    OUT/gate/verdict.json        the verdict, summary.md and junit.xml beside it
    OUT/publish/publish.json     what was published (or why not)

A published Hub repo holds the checkpoint's files at its root, the model card as README.md, the
figures under figures/ and the run's reports under mxspec/, with mxspec/files.json listing every file
the last publish put there.

A stage writes into a temporary folder that the runner renames to OUT/<stage>, so stages use the
file names; everything that reads a finished run uses `RunLayout`'s paths.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

__all__ = ["STATE_DIR", "LOCK_FILE", "HASH_CACHE_FILE", "STAGE_LOGS", "MANIFEST", "QUANTIZE_REPORT", "CHECKPOINT",
    "PAIR_FILE", "REPORT_FILE", "REPORT_MARKDOWN", "CELLS", "SERVER_LOGS", "VERDICT_FILE", "SUMMARY_FILE",
    "JUNIT_FILE", "PUBLISH_FILE", "CARD_FILE", "REPO_FIGURES", "REPO_REPORTS", "PUBLISHED_LIST", "resolved_file",
    "RunLayout"]

STATE_DIR = ".mxspec"
LOCK_FILE = "lock"
HASH_CACHE_FILE = "hash-cache.json"
STAGE_LOGS = "logs"  # under STATE_DIR: third-party output of each stage's last run (`stage_log`)
MANIFEST = "manifest.json"
QUANTIZE_REPORT = "mxspec-quantize.json"
CHECKPOINT = "checkpoint"
PAIR_FILE = "pair.json"
REPORT_FILE = "report.json"
REPORT_MARKDOWN = "report.md"
CELLS = "cells"  # under STATE_DIR: validate's cell store; under the validate folder: links to the cells used
SERVER_LOGS = "servers"  # under STATE_DIR/STAGE_LOGS
VERDICT_FILE = "verdict.json"
SUMMARY_FILE = "summary.md"
JUNIT_FILE = "junit.xml"
PUBLISH_FILE = "publish.json"

# In a published repo
CARD_FILE = "README.md"
REPO_FIGURES = "figures"
REPO_REPORTS = "mxspec"
PUBLISHED_LIST = f"{REPO_REPORTS}/files.json"


def resolved_file(role: str) -> str:
    """One file per role, so a stage can depend on the target alone (quantize) or on both (pair)."""
    return f"{role}.json"


class _StageFile:
    """A file in one stage's folder, read as a path attribute of a `RunLayout`."""

    def __init__(self, stage: str, name: str):
        self.stage, self.name = stage, name

    def __get__(self, layout: RunLayout | None, owner: type | None = None) -> Path:
        if layout is None:
            raise AttributeError(f"{self.stage}/{self.name} is a path of a RunLayout instance")
        return layout.stage(self.stage) / self.name


@dataclass(frozen=True)
class RunLayout:
    """The paths of one run folder."""

    out: Path

    def stage(self, name: str) -> Path:
        return self.out / name

    def manifest(self, stage: str) -> Path:
        return self.stage(stage) / MANIFEST

    @property
    def state(self) -> Path:
        return self.out / STATE_DIR

    @property
    def lock(self) -> Path:
        return self.state / LOCK_FILE

    @property
    def hash_cache(self) -> Path:
        return self.state / HASH_CACHE_FILE

    def stage_log(self, stage: str) -> Path:
        return self.state / STAGE_LOGS / f"{stage}.log"

    @property
    def server_logs(self) -> Path:
        return self.state / STAGE_LOGS / SERVER_LOGS

    @property
    def cells(self) -> Path:
        return self.state / CELLS

    def resolved(self, role: str) -> Path:
        return self.stage("resolve") / resolved_file(role)

    # Each stage's main outputs, as OUT/<stage>/<file>
    quantize_report = _StageFile("quantize", QUANTIZE_REPORT)
    checkpoint = _StageFile("quantize", CHECKPOINT)
    pair = _StageFile("pair", PAIR_FILE)
    report = _StageFile("validate", REPORT_FILE)
    report_markdown = _StageFile("validate", REPORT_MARKDOWN)
    verdict = _StageFile("gate", VERDICT_FILE)
    summary = _StageFile("gate", SUMMARY_FILE)
    publish_result = _StageFile("publish", PUBLISH_FILE)

    def reports(self) -> list[Path]:
        """The run's own reports, in the order a published repo lists them under mxspec/."""
        return [self.quantize_report, self.pair, self.report, self.report_markdown, self.verdict, self.summary]
