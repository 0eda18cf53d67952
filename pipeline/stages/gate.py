"""Gate stage: turn a validation report into a CI verdict.

The gate never re-measures, and it alone holds thresholds (validate's fingerprint leaves `[gate]`
out, so changing a threshold re-runs this stage only). It reads `validate/report.json`, applies the
recipe's thresholds to each (workload, budget) cell, every measure of it in one check (own text at each
concurrency, same text, fidelity however measured, accuracy; and the MTP head's served and same-text
drift in a check of its own), using the bootstrap intervals (`drift.decide`: fail only when the drop
is significantly beyond the threshold, inconclusive when the interval straddles it) and, when the
recipe asks for a minimum MXFP4 throughput lift, to the vLLM serving rows. Outputs, for people and CI
systems: verdict.json (schema `mxspec.gate/1`), summary.md (a job summary or PR comment) and
junit.xml with one test case per (workload, budget) and per throughput check.

Exit codes: 0 pass (or inconclusive under `on_inconclusive = "pass"`), 1 fail, 2 unreadable report.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from xml.etree import ElementTree

from pipeline.errors import BadInputError, GateFailedError
from pipeline.recipe import Gate
from pipeline.run.artifacts import (
    MEASURED_BY,
    DriftRow,
    GateCheck,
    GateVerdict,
    ServedRow,
    ValidateReport,
    read_artifact,
    read_validate_report,
    write_artifact,
)
from pipeline.run.hashing import sha256_file
from pipeline.run.layout import JUNIT_FILE, SUMMARY_FILE, VERDICT_FILE
from pipeline.run.runner import StageContext
from pipeline.study.drift import decide, drop_interval

__all__ = ["SEVERITY", "read_report", "gate_report", "ICON", "summary_markdown", "junit_xml", "write_gate_outputs",
    "read_verdict", "GateStage", "raise_unless_passed"]

SEVERITY = {"pass": 0, "inconclusive": 1, "fail": 2}


def read_report(path: Path) -> ValidateReport:
    """A validate report checked against its schema and itself, with bf16-vs-MXFP4 drift rows to gate."""
    report = read_validate_report(path)
    if not report.drift:
        raise BadInputError(f"{path}: the report has no bf16-vs-MXFP4 drift rows; validate with precisions ['bf16', 'mxfp4']")
    return report


def gate_report(report_path: Path, thresholds: Gate) -> GateVerdict:
    """Apply the thresholds to every drift row (and throughput pair). The report holds measurements and
    intervals only, so thresholds change without re-measuring."""
    report = read_report(report_path)
    checks = [_acceptance_check(row, thresholds, report) for row in report.drift]
    if thresholds.max_mtp_acceptance_drop is not None:
        cells = dict.fromkeys((r.workload, r.budget) for r in report.mtp_drift + report.mtp_same_text_drift)
        checks += [_mtp_check(workload, budget, thresholds, report) for workload, budget in cells]
    if thresholds.min_throughput_lift is not None:
        checks += _throughput_checks(report.serving or [], thresholds.min_throughput_lift)
    verdict = max((c.verdict for c in checks), key=SEVERITY.__getitem__)
    passed = verdict == "pass" or (verdict == "inconclusive" and thresholds.on_inconclusive == "pass")
    return GateVerdict(verdict=verdict, passed=passed, exit_code=0 if passed else 1, thresholds=thresholds,
                       report=str(report_path), report_sha256=sha256_file(Path(report_path)), checks=checks)


@dataclass(frozen=True)
class _Measure:
    name: str  # own text | same text | fidelity | accuracy
    verdict: str
    detail: str


def _over(value: float, threshold: float, verdict: str, word: str = "over") -> str:
    return f": {abs(value - threshold):.3f} {word}" if verdict == "fail" else ""


def _acceptance_check(row: DriftRow, gate: Gate, report: ValidateReport) -> GateCheck:
    """Every measure of one (workload, budget), each against its threshold:
      own text   the mean-AL drop and the worst per-position drop on each precision's own text (what users get);
      same text  the mean-AL drop with bf16's text held fixed (drafter/target alignment alone);
      fidelity   the MXFP4 target's top-1 agreement with bf16 and its KL, on bf16's text;
      accuracy   the task accuracy drop, where answers finished.
    A cell whose own-text acceptance did not fail while fidelity fails is 'target degraded': its text may
    have become easier to draft because the target broke."""
    measures = [_own_text(row, gate)]
    measures += [_own_text(r, gate) for r in _higher_concurrency(report, "dflash", row.workload, row.budget)]
    same = report.same_text_row(row.workload, row.budget)
    if same is not None:
        drop_ci = drop_interval(same.ci95)
        verdict = decide(drop_ci, gate.max_same_text_drop)
        measures.append(_Measure("same text", verdict, (
            f"same-text mean AL drop {-same.delta:+.3f} (95% CI {drop_ci[0]:+.3f}..{drop_ci[1]:+.3f}) vs max "
            f"{gate.max_same_text_drop}{_over(-same.delta, gate.max_same_text_drop, verdict)} -> {verdict}")))
    fidelities = report.fidelity_rows(row.workload)
    for fidelity in fidelities:
        by = f" ({MEASURED_BY[fidelity.measured_by]})" if len(fidelities) > 1 else ""
        if gate.min_top1_agreement is not None:
            low, high = fidelity.top1_agreement_ci95
            verdict = decide((1 - high, 1 - low), 1 - gate.min_top1_agreement)
            measures.append(_Measure("fidelity", verdict, (
                f"top-1 agreement{by} {fidelity.top1_agreement:.3f} (95% CI {low:.3f}..{high:.3f}) vs min "
                f"{gate.min_top1_agreement}{_over(fidelity.top1_agreement, gate.min_top1_agreement, verdict, 'short')} "
                f"-> {verdict}")))
        if gate.max_kl is not None:
            verdict = decide(tuple(fidelity.kl_ci95), gate.max_kl)
            measures.append(_Measure("fidelity", verdict, (
                f"KL{by} {fidelity.kl:.3f} (95% CI {fidelity.kl_ci95[0]:.3f}..{fidelity.kl_ci95[1]:.3f}) vs max "
                f"{gate.max_kl}{_over(fidelity.kl, gate.max_kl, verdict)} -> {verdict}")))
    accuracy = report.accuracy_row(row.workload)
    if accuracy is not None and gate.max_accuracy_drop is not None:
        drop_ci = drop_interval(accuracy.delta_ci95)
        verdict = decide(drop_ci, gate.max_accuracy_drop)
        measures.append(_Measure("accuracy", verdict, (
            f"accuracy drop {-accuracy.delta:+.3f} (95% CI {drop_ci[0]:+.3f}..{drop_ci[1]:+.3f}) vs max "
            f"{gate.max_accuracy_drop}{_over(-accuracy.delta, gate.max_accuracy_drop, verdict)} -> {verdict}")))
    verdict = max((m.verdict for m in measures), key=SEVERITY.__getitem__)
    failed = {m.name for m in measures if m.verdict == "fail"}
    cause = ""
    own_text_held = "own text" not in failed
    if own_text_held and failed & {"fidelity", "accuracy"}:
        cause = "target degraded: "
    elif own_text_held and "same text" in failed:
        cause = "same-text acceptance dropped: "
    unmeasured = "" if same is not None or fidelities else (
        "; same-text acceptance and fidelity not measured (they need the reference backend, or the bf16 and "
        "MXFP4 AR servers)")
    measured = {"delta": row.delta, "ci95": list(row.ci95), "max_position_gap": row.max_position_gap,
                "num_prompts": row.num_prompts}
    if same is not None:
        measured["same_text_delta"] = same.delta
    if fidelities:  # the worse of the ways it was measured
        measured |= {"top1_agreement": min(f.top1_agreement for f in fidelities), "kl": max(f.kl for f in fidelities)}
    if accuracy is not None:
        measured["accuracy_delta"] = accuracy.delta
    return GateCheck(name=f"{row.workload} B={row.budget}", workload=row.workload, kind="acceptance", verdict=verdict,
                     reason=cause + "; ".join(m.detail for m in measures) + unmeasured, measured=measured)


def _higher_concurrency(report: ValidateReport, method: str, workload: str, budget: int) -> list[DriftRow]:
    """The cell's served rows above concurrency 1 (vLLM's per-request metrics), lowest first."""
    return sorted((r for r in report.served_drift if (r.method, r.workload, r.budget) == (method, workload, budget)),
                  key=lambda r: r.concurrency)


def _mtp_check(workload: str, budget: int, gate: Gate, report: ValidateReport) -> GateCheck:
    """The MXFP4 checkpoint's MTP head against bf16's for one (workload, steps + 1): served at each
    concurrency (a head that lost its weights or its declarations collapses to AL ~1, users' reports,
    which DFlash rows never show) and replayed along bf16's text (the head with the text held fixed)."""
    def row(rows: list[DriftRow]) -> list[DriftRow]:
        return [r for r in rows if (r.workload, r.budget) == (workload, budget)]

    rows = [("served", r) for r in row(report.mtp_drift)]
    rows += [(f"served at concurrency {r.concurrency}", r) for r in _higher_concurrency(report, "mtp", workload, budget)]
    rows += [("same-text", r) for r in row(report.mtp_same_text_drift)]
    details, verdicts = [], []
    for what, r in rows:
        drop_ci = drop_interval(r.ci95)
        verdicts.append(decide(drop_ci, gate.max_mtp_acceptance_drop))
        details.append(f"{what} MTP mean AL drop {-r.delta:+.3f} (95% CI {drop_ci[0]:+.3f}..{drop_ci[1]:+.3f}) vs max "
                       f"{gate.max_mtp_acceptance_drop}{_over(-r.delta, gate.max_mtp_acceptance_drop, verdicts[-1])} "
                       f"-> {verdicts[-1]}")
    verdict = max(verdicts, key=SEVERITY.__getitem__)
    first = rows[0][1]
    return GateCheck(name=f"{workload} MTP B={budget}", workload=workload, kind="acceptance", verdict=verdict,
                     reason=("MTP head degraded: " if verdict == "fail" else "") + "; ".join(details),
                     measured={"delta": first.delta, "ci95": list(first.ci95), "num_prompts": first.num_prompts})


def _own_text(row: DriftRow, gate: Gate) -> _Measure:
    """Mean-AL drop and the worst per-position drop, each precision on its own greedy text (at the
    row's concurrency, when it is a served row above 1)."""
    drop_ci = drop_interval(row.ci95)
    al_verdict = decide(drop_ci, gate.max_acceptance_length_drop)
    position_verdicts = [decide(tuple(ci), gate.max_position_gap) for ci in row.position_drop_ci95]
    worst = max(range(len(position_verdicts)), key=lambda i: (SEVERITY[position_verdicts[i]], row.position_drop_ci95[i][1]))
    verdict = max(al_verdict, position_verdicts[worst], key=SEVERITY.__getitem__)
    low, high = row.position_drop_ci95[worst]
    at = f"at concurrency {row.concurrency}: " if row.concurrency else ""
    return _Measure("own text", verdict, (
        f"{at}mean AL drop {-row.delta:+.3f} (95% CI {drop_ci[0]:+.3f}..{drop_ci[1]:+.3f}) vs max "
        f"{gate.max_acceptance_length_drop}{_over(-row.delta, gate.max_acceptance_length_drop, al_verdict)} -> {al_verdict}; "
        f"worst position {worst + 1} drop 95% CI {low:+.3f}..{high:+.3f} vs max {gate.max_position_gap} -> "
        f"{position_verdicts[worst]}"))


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
             f"Thresholds: mean AL drop <= {t.max_acceptance_length_drop}, per-position drop <= {t.max_position_gap}, "
             f"same-text mean AL drop <= {t.max_same_text_drop}"
             + (f", top-1 agreement >= {t.min_top1_agreement}" if t.min_top1_agreement is not None else "")
             + (f", KL <= {t.max_kl}" if t.max_kl is not None else "")
             + (f", accuracy drop <= {t.max_accuracy_drop}" if t.max_accuracy_drop is not None else "")
             + (f", served MTP mean AL drop <= {t.max_mtp_acceptance_drop}" if t.max_mtp_acceptance_drop is not None else "")
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
    version = 2
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
                              f"(see {folder / SUMMARY_FILE})", verdict=folder / VERDICT_FILE)
