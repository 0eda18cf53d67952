"""Gate stage: turn a validation report into a CI verdict.

The gate never re-measures. It reads `validate/report.json`, applies the recipe's thresholds to each
(workload, budget) drift row using the bootstrap intervals (`drift.decide`: fail only when the drop
is significantly beyond the threshold, inconclusive when the interval straddles it) and, when the
recipe asks for a minimum MXFP4 throughput lift, to the vLLM serving rows. Outputs, for people and CI
systems: verdict.json (schema `mxspec.gate/1`), summary.md (a job summary or PR comment) and
junit.xml with one test case per (workload, budget) and per throughput check.

Exit codes: 0 pass (or inconclusive under `on_inconclusive = "pass"`), 1 fail, 2 unreadable report.
"""

from __future__ import annotations

from pathlib import Path
from xml.etree import ElementTree

from pipeline.artifacts import (
    DriftRow,
    GateCheck,
    GateVerdict,
    ServedRow,
    ValidateReport,
    read_artifact,
    read_validate_report,
    write_artifact,
)
from pipeline.drift import decide
from pipeline.errors import BadInputError, GateFailedError
from pipeline.hashing import sha256_file
from pipeline.layout import JUNIT_FILE, SUMMARY_FILE, VERDICT_FILE
from pipeline.recipe import Gate
from pipeline.runner import StageContext

SEVERITY = {"pass": 0, "inconclusive": 1, "fail": 2}


def read_report(path: Path) -> ValidateReport:
    """A validate report checked against its schema and itself, with bf16-vs-MXFP4 drift rows to gate."""
    report = read_validate_report(path)
    if not report.drift:
        raise BadInputError(f"{path}: the report has no bf16-vs-MXFP4 drift rows; validate with precisions ['bf16', 'mxfp4']")
    return report


def gate_report(report_path: Path, thresholds: Gate | None = None) -> GateVerdict:
    """Apply the thresholds (default: those the report records) to every drift row (and throughput pair)."""
    report = read_report(report_path)
    thresholds = thresholds or report.gate
    checks = [_acceptance_check(row, thresholds) for row in report.drift]
    if thresholds.min_throughput_lift is not None:
        checks += _throughput_checks(report.serving or [], thresholds.min_throughput_lift)
    verdict = max((c.verdict for c in checks), key=SEVERITY.__getitem__)
    passed = verdict == "pass" or (verdict == "inconclusive" and thresholds.on_inconclusive == "pass")
    return GateVerdict(verdict=verdict, passed=passed, exit_code=0 if passed else 1, thresholds=thresholds,
                       report=str(report_path), report_sha256=sha256_file(Path(report_path)), checks=checks)


def _acceptance_check(row: DriftRow, gate: Gate) -> GateCheck:
    """Mean-AL drop and the worst per-position drop of one (workload, budget), each against its threshold."""
    drop_ci = (-row.ci95[1], -row.ci95[0])
    al_verdict = decide(drop_ci, gate.max_acceptance_length_drop)
    position_verdicts = [decide(tuple(ci), gate.max_position_gap) for ci in row.position_drop_ci95]
    worst = max(range(len(position_verdicts)), key=lambda i: (SEVERITY[position_verdicts[i]], row.position_drop_ci95[i][1]))
    verdict = max(al_verdict, position_verdicts[worst], key=SEVERITY.__getitem__)
    low, high = row.position_drop_ci95[worst]
    reason = (f"mean AL drop {-row.delta:+.3f} (95% CI {drop_ci[0]:+.3f}..{drop_ci[1]:+.3f}) vs max "
              f"{gate.max_acceptance_length_drop} -> {al_verdict}; worst position {worst + 1} drop 95% CI "
              f"{low:+.3f}..{high:+.3f} vs max {gate.max_position_gap} -> {position_verdicts[worst]}")
    measured = {"delta": row.delta, "ci95": list(row.ci95), "max_position_gap": row.max_position_gap,
                "worst_position": worst + 1, "num_prompts": row.num_prompts}
    return GateCheck(name=f"{row.workload} B={row.budget}", workload=row.workload, kind="acceptance", verdict=verdict,
                     reason=reason, measured=measured)


def _throughput_checks(serving: list[ServedRow], min_lift: float) -> list[GateCheck]:
    """MXFP4 over bf16 throughput for each served cell measured at both precisions."""
    rows = {(r.workload, r.method, r.budget, r.concurrency, r.precision): r for r in serving}
    checks = []
    for (workload, method, budget, concurrency, precision), quant in sorted(rows.items(), key=str):
        base = rows.get((workload, method, budget, concurrency, "bf16"))
        if precision != "mxfp4" or base is None:
            continue
        lift = quant.throughput_tok_s / base.throughput_tok_s - 1
        verdict = "pass" if lift >= min_lift else "fail"
        cell = f"{workload} {method}" + (f" B={budget}" if budget else "") + f" c={concurrency}"
        checks.append(GateCheck(
            name=f"throughput {cell}", workload=workload, kind="throughput", verdict=verdict,
            reason=f"MXFP4 throughput lift {lift:+.1%} vs min {min_lift:+.1%} (one run each, no interval)",
            measured={"lift": lift, "bf16_tok_s": base.throughput_tok_s, "mxfp4_tok_s": quant.throughput_tok_s}))
    if not checks:
        checks.append(GateCheck(name="throughput", workload="-", kind="throughput", verdict="inconclusive",
                                reason="min_throughput_lift is set but the report has no vLLM throughput at both precisions"))
    return checks


ICON = {"pass": "PASS", "fail": "FAIL", "inconclusive": "INCONCLUSIVE"}


def summary_markdown(result: GateVerdict) -> str:
    t = result.thresholds
    policy = f"inconclusive counts as {t.on_inconclusive}"
    lines = [f"## mxspec gate: {ICON[result.verdict]}" + ("" if result.verdict != "inconclusive" else f" ({policy})"),
             "",
             f"Thresholds: mean AL drop <= {t.max_acceptance_length_drop}, per-position drop <= {t.max_position_gap}"
             + (f", MXFP4 throughput lift >= {t.min_throughput_lift:+.0%}" if t.min_throughput_lift is not None else "")
             + f"; {policy}. A cell fails only when the 95% interval lies beyond the threshold.",
             "", "| cell | verdict | why |", "|---|---|---|"]
    for check in result.checks:
        lines.append(f"| {check.name} | {ICON[check.verdict]} | {check.reason} |")
    counts = {v: sum(c.verdict == v for c in result.checks) for v in ICON}
    lines += ["", (f"{counts['pass']} pass, {counts['fail']} fail, {counts['inconclusive']} inconclusive; "
              f"report `{result.report}` (sha256 {result.report_sha256[:12]})"), ""]
    return "\n".join(lines)


def junit_xml(result: GateVerdict) -> str:
    """One <testcase> per check; fail -> <failure>, inconclusive -> <failure> or <skipped> by policy."""
    suite = ElementTree.Element("testsuite", name="mxspec.gate", tests=str(len(result.checks)))
    failures = skipped = 0
    for check in result.checks:
        case = ElementTree.SubElement(suite, "testcase", classname=f"mxspec.gate.{check.kind}.{check.workload}",
                                      name=check.name, time="0")
        if check.verdict == "fail" or (check.verdict == "inconclusive" and result.thresholds.on_inconclusive == "fail"):
            failures += 1
            ElementTree.SubElement(case, "failure", message=f"{check.verdict}: {check.reason}")
        elif check.verdict == "inconclusive":
            skipped += 1
            ElementTree.SubElement(case, "skipped", message=f"inconclusive: {check.reason}")
        else:
            ElementTree.SubElement(case, "system-out").text = check.reason
    suite.set("failures", str(failures))
    suite.set("skipped", str(skipped))
    suite.set("errors", "0")
    ElementTree.indent(suite)
    return '<?xml version="1.0" encoding="utf-8"?>\n' + ElementTree.tostring(suite, encoding="unicode") + "\n"


def write_gate_outputs(result: GateVerdict, folder: Path) -> None:
    """verdict.json, summary.md and junit.xml into `folder` (which the caller makes atomic)."""
    folder.mkdir(parents=True, exist_ok=True)
    write_artifact(result, folder / VERDICT_FILE)
    (folder / SUMMARY_FILE).write_text(summary_markdown(result))
    (folder / JUNIT_FILE).write_text(junit_xml(result))


def read_verdict(folder: Path) -> GateVerdict:
    return read_artifact(folder / VERDICT_FILE, GateVerdict, "run the gate again (`mxspec run RECIPE --until gate`)")


class GateStage:
    """Writes the verdict whatever it is; `mxspec run` then exits 1 and publish refuses on a failed gate."""

    name = "gate"
    version = 1
    sections = ("gate",)
    requires = ("validate",)
    tools = ()

    def external_inputs(self, ctx: StageContext) -> dict[str, Path]:
        return {}

    def run(self, ctx: StageContext, workdir: Path) -> None:
        result = gate_report(ctx.run.report, ctx.recipe.gate)
        write_gate_outputs(result, workdir)
        ctx.console.print(f"  gate: {ICON[result.verdict]} ({len(result.checks)} checks; "
                          f"{'passes' if result.passed else 'fails'} under the recipe's policy)")


def raise_unless_passed(folder: Path) -> None:
    """GateFailedError (exit 1) with the failing cells, if the gate in `folder` did not pass."""
    verdict = read_verdict(folder)
    if not verdict.passed:
        bad = [c.name for c in verdict.checks if c.verdict != "pass"]
        raise GateFailedError(f"gate {verdict.verdict}: {', '.join(bad[:6])}{' ...' if len(bad) > 6 else ''} "
                              f"(see {folder / SUMMARY_FILE})")
