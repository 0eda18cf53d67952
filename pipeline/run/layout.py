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

    @property
    def quantize_report(self) -> Path:
        return self.stage("quantize") / QUANTIZE_REPORT

    @property
    def checkpoint(self) -> Path:
        return self.stage("quantize") / CHECKPOINT

    @property
    def pair(self) -> Path:
        return self.stage("pair") / PAIR_FILE

    @property
    def report(self) -> Path:
        return self.stage("validate") / REPORT_FILE

    @property
    def report_markdown(self) -> Path:
        return self.stage("validate") / REPORT_MARKDOWN

    @property
    def verdict(self) -> Path:
        return self.stage("gate") / VERDICT_FILE

    @property
    def summary(self) -> Path:
        return self.stage("gate") / SUMMARY_FILE

    @property
    def publish_result(self) -> Path:
        return self.stage("publish") / PUBLISH_FILE

    def reports(self) -> list[Path]:
        """The run's own reports, in the order a published repo lists them under mxspec/."""
        return [self.quantize_report, self.pair, self.report, self.report_markdown, self.verdict, self.summary]
