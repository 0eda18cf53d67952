"""The `mxspec` command line: a thin layer over the stage entry points.

Exit codes: 0 ok, 1 gate failed, 2 bad input, 3 an external component failed.
"""

from __future__ import annotations

import functools
import os
import sys
import traceback
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from pipeline.errors import MxspecError, NotSizedError
from pipeline.recipe import NO_MTP_HEAD_IN_MEMORY, Gate, Recipe, load_recipe
from pipeline.run.layout import RunLayout
from pipeline.run.stage_log import VERBOSE_ENV

__all__ = ["app", "recipe_app", "err", "options", "RecipeArg", "OutOpt", "ExecutorOpt", "RayAddressOpt",
    "recipe_check", "plan", "run", "quantize", "pair", "validate", "gate", "publish", "main"]

app = typer.Typer(
    name="mxspec",
    help="Quantize a target to MXFP4 with AMD Quark, pair it with its unchanged DFlash drafter, "
    "validate acceptance drift, gate the result and publish it.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
recipe_app = typer.Typer(help="Inspect recipes.", no_args_is_help=True)
app.add_typer(recipe_app, name="recipe")

err = Console(stderr=True, highlight=False, soft_wrap=True)


@app.callback()
def options(
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="show other tools' output (Quark, transformers, "
                                          "vLLM) on the terminal instead of OUT/.mxspec/logs/<stage>.log")] = False,
) -> None:
    if verbose:
        os.environ[VERBOSE_ENV] = "1"  # read by every stage this process runs (`pipeline.run.stage_log`)

RecipeArg = Annotated[Path, typer.Argument(help="recipe TOML file, e.g. recipes/reference-cpu.toml", show_default=False)]
OutOpt = Annotated[Path, typer.Option("--out", "-o", help="output folder; one subfolder per stage")]
ExecutorOpt = Annotated[Optional[str], typer.Option(
    "--executor", help="where validate's cells run: 'local' (one at a time here) or 'ray' (Ray tasks); "
    "default: the recipe's [cluster] executor", show_default=False)]
RayAddressOpt = Annotated[Optional[str], typer.Option(
    "--ray-address", help="Ray cluster to join (implies --executor ray); default: [cluster] address, "
    "then RAY_ADDRESS, else a local cluster", show_default=False)]


def _recipe_on(path: Path, executor: str | None, ray_address: str | None) -> Recipe:
    """The recipe with the command line's choice of executor (the preflight checks that Ray is importable)."""
    from pipeline.errors import BadInputError

    recipe = load_recipe(path)
    if executor not in (None, "local", "ray"):
        raise BadInputError(f"--executor {executor}: choose 'local' or 'ray'")
    update = {k: v for k, v in {"executor": "ray" if ray_address and not executor else executor,
                                 "address": ray_address}.items() if v}
    if update:
        recipe = recipe.model_copy(update={"cluster": recipe.cluster.model_copy(update=update)})
    return recipe


def _guarded(command):
    """Turn expected failures into one line on stderr and their exit code; no traceback."""

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except MxspecError as exc:
            if os.environ.get("MXSPEC_TRACEBACK"):
                traceback.print_exc()
            err.print(f"[red]error:[/] {escape(str(exc))}")
            raise typer.Exit(exc.exit_code) from None
        except typer.Exit:  # a command's own exit code (e.g. gate: 1 on fail)
            raise
        except KeyboardInterrupt:
            err.print("[red]interrupted[/]; run the same command again to resume")
            raise typer.Exit(130) from None
        except Exception as exc:  # a bug: say so in one line, keep the traceback behind a switch
            if os.environ.get("MXSPEC_TRACEBACK"):
                traceback.print_exc()
            err.print(f"[red]internal error:[/] {exc.__class__.__name__}: {escape(str(exc))} (set MXSPEC_TRACEBACK=1 for details)")
            raise typer.Exit(3) from None

    return wrapper


@recipe_app.command("check")
@_guarded
def recipe_check(recipe: RecipeArg) -> None:
    """Validate a recipe and print what it will run. Exit 2 with one line per problem."""
    from pipeline.stages.preflight import preflight

    loaded = load_recipe(recipe)
    notes = preflight(loaded)
    Console().print(_recipe_table(recipe, loaded))
    for note in notes:
        err.print(f"[yellow]note:[/] {escape(note)}")


@app.command()
@_guarded
def plan(
    recipe: RecipeArg,
    gpus: Annotated[int, typer.Option("--gpus", help="GPUs per node")] = 8,
    nodes: Annotated[int, typer.Option("--nodes", help="nodes in the cluster")] = 1,
    json_path: Annotated[Optional[Path], typer.Option("--json", help="also write the plan here as JSON")] = None,
    run_out: Annotated[Optional[Path], typer.Option("--run", help="a run folder: show each kept cell's measured "
                                                    "time beside its estimate")] = None,
) -> None:
    """Estimate the study before running it: its cells, longest first, and its wall time on one GPU, on
    one node of GPUS and on NODES such nodes. Estimates come from the recipe's [plan] rates."""
    from pipeline.errors import BadInputError
    from pipeline.run.atomic import atomic_write_text, check_output_file
    from pipeline.study.cells import read_timing
    from pipeline.study.plan import plan_study

    if gpus < 1 or nodes < 1:
        raise BadInputError(f"--gpus {gpus} --nodes {nodes}: both must be at least 1")
    if json_path is not None:
        check_output_file(json_path, "--json file")
    if run_out is not None and not RunLayout(run_out).cells.is_dir():
        raise BadInputError(f"--run {run_out}: no validate cells there; pass the --out folder of a run that validated")
    from pipeline.stages.preflight import memory_plan

    loaded = load_recipe(recipe)
    try:
        memory, unsized = memory_plan(loaded), None
    except NotSizedError as exc:
        memory, unsized = None, exc.message
    study = plan_study(loaded, gpus_per_node=gpus, nodes=nodes, memory=memory)
    out = Console()
    if study.quantize is not None:
        q, rates = study.quantize, loaded.plan
        out.print(f"quantize: {_hours(q.estimate_s)} (file to file, MXFP4 kernel on {rates.quantize_cpus} CPU cores)")
        out.print(f"  {q.source_format} {_size(q.source_bytes)} -> MXFP4 {_size(q.export_bytes)}: I/O {_hours(q.io_s)} "
                  f"at {rates.storage_gb_s:g} GB/s, encoding {_hours(q.encode_s)}")
    else:
        out.print(f"quantize: no estimate ({escape(unsized)})")
    measured = f"; measured: the cells kept in {run_out}" if run_out is not None else ", not measurements"
    table = Table(title=escape(f"{study.recipe}: {len(study.cells)} cells (estimates{measured})"),
                  title_justify="left")
    columns = ("cell", "GPUs", "tokens", "estimate") + (("measured",) if run_out is not None else ())
    for column in columns:
        table.add_column(column, justify="left" if column == "cell" else "right")
    for cell in study.cells:
        row = [cell.name, str(cell.gpus), f"{cell.output_tokens:,}", _hours(cell.estimate_s)]
        if run_out is not None:
            timing = read_timing(RunLayout(run_out).cells, cell.name)
            row.append(_hours(timing.seconds) + ("" if timing.where == "here" else f" on {timing.where}") if timing else "-")
        table.add_row(*map(escape, row))
    out.print(table)
    for s in study.schedules:
        where = f"{s.nodes} node{'s' if s.nodes > 1 else ''} x {s.gpus_per_node} GPU{'s' if s.gpus_per_node > 1 else ''}"
        out.print(f"wall time on {where}: {_hours(s.wall_s)}")
    widest = study.schedules[-1]
    out.print(f"schedule on {widest.nodes} x {widest.gpus_per_node} GPUs, longest first:")
    for p in widest.placements:
        out.print(f"  node {p.node} GPU {','.join(map(str, p.gpus))}: {p.cell} {_hours(p.start_s)} -> {_hours(p.end_s)}")
    if json_path is not None:
        atomic_write_text(json_path, study.model_dump_json(indent=2) + "\n")


def _hours(seconds: float) -> str:
    return f"{seconds / 3600:.1f} h" if seconds >= 3600 else f"{seconds / 60:.1f} min"


def _recipe_table(path: Path, recipe: Recipe) -> Table:
    v, q = recipe.validation, recipe.quantization
    table = Table(title=escape(f"{path}: ok"), show_header=False, title_justify="left")
    rows = {
        "name": recipe.name,
        "target": recipe.target.describe() + ("" if recipe.target.pinned else "  (revision not pinned)"),
        "drafter": recipe.drafter.describe() + ("" if recipe.drafter.pinned else "  (revision not pinned)"),
        "quantization": f"{q.scheme}, exclude={q.exclude if q.exclude is not None else 'family defaults'}, "
        f"quantize_mtp={q.quantize_mtp}, mode={q.mode}",
        "workloads": ", ".join(v.workloads),
        "matrix": f"methods {v.methods} x budgets {v.budgets} x concurrency {v.concurrency} x precisions {v.precisions}",
        "prompts": f"{v.num_prompts} per workload, max {v.max_tokens} output tokens, seed {v.seed}",
        "backends": ", ".join(v.backends),
        "gate": f"max AL drop {recipe.gate.max_acceptance_length_drop}, max position gap {recipe.gate.max_position_gap}, "
        f"inconclusive -> {recipe.gate.on_inconclusive}",
        "vLLM serves": "-" if "vllm" not in v.backends else
        f"{', '.join(recipe.served.workloads)}; budgets {recipe.served.budgets}; {recipe.served.num_prompts} prompts per "
        "workload" + ("; eager (no torch.compile)" if recipe.serving.enforce_eager else ""),
        "serving env": " ".join(f"{k}={v_}" for k, v_ in recipe.serving.env.items()) or "-",
        "cells run on": "this process" if recipe.cluster.executor == "local" else
        f"Ray ({recipe.cluster.address or 'RAY_ADDRESS or a local cluster'}), each cell reserving "
        + {"gpu": "its server's GPUs", "cpu": f"{recipe.cluster.cpus_per_cell} CPUs",
           "auto": f"its server's GPUs (or {recipe.cluster.cpus_per_cell} CPUs on a cluster without GPUs)"}[recipe.cluster.device],
        "publish": recipe.publish.repo_id or "-",
    }
    rows |= _memory_rows(recipe)
    for key, value in rows.items():
        table.add_row(key, escape(value))
    return table


def _size(n: int) -> str:
    return f"{n / 1e9:.1f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"


def _memory_rows(recipe: Recipe) -> dict[str, str]:
    """Sizes from the configs alone, `auto`'s quantize mode here, and the one-MI355X fit (pipeline.quant.memory)."""
    from pipeline.quant.memory import IN_MEMORY_FACTOR
    from pipeline.stages.preflight import memory_plan

    try:
        plan = memory_plan(recipe)
    except NotSizedError as why:
        return {"memory plan": f"- ({why})"}
    per_gpu = int(plan.gpu_bytes * plan.gpu_memory_utilization)
    drafter = f"drafter {_size(plan.drafter_bytes)}" if plan.drafter_bytes is not None else \
        "drafter config not known here (not counted)"
    return {
        "sizes": f"target {plan.source_format} {_size(plan.source_bytes)} -> MXFP4 {_size(plan.mxfp4_bytes)}; {drafter}",
        "auto mode here": f"{plan.quantize_mode_here} (quantize_mtp: {NO_MTP_HEAD_IN_MEMORY})"
                          if plan.quantizes_mtp_head else
                          f"{plan.quantize_mode_here} ({_size(plan.available_bytes)} free; in memory needs "
                          f"{IN_MEMORY_FACTOR} x the model as held: "
                          f"{'float32, dequantized' if plan.source_format == 'fp8' else 'bf16'})",
        "one MI355X": f"{'fits' if plan.fits else 'does not fit'}: {_size(plan.need_bytes_per_gpu)} of "
                      f"{_size(per_gpu)} per GPU for the {plan.largest_server.upper()} server's weights and one "
                      f"{plan.max_model_len}-token sequence (TP {plan.tensor_parallel_size}, utilization "
                      f"{plan.gpu_memory_utilization}); full-length sequences at once: {plan.full_length_sequences}",
    }


@app.command()
@_guarded
def run(
    recipe: RecipeArg,
    out: OutOpt = Path("runs/latest"),
    until: Annotated[Optional[str], typer.Option("--until", help="stop after this stage, e.g. gate (skip publishing)")] = None,
    force: Annotated[list[str], typer.Option("--force", help="redo this stage even if up to date (repeatable)")] = [],
    executor: ExecutorOpt = None,
    ray_address: RayAddressOpt = None,
) -> None:
    """Run every stage in order into OUT, resuming: stages already done are skipped.

    Stages: resolve, quantize, pair, validate, gate, publish. Exits 1 when the gate does not pass
    (nothing is published then)."""
    from pipeline.entrypoints import run_pipeline
    from pipeline.stages.gate import raise_unless_passed

    results = run_pipeline(_recipe_on(recipe, executor, ray_address), out, until=until, force=tuple(force))
    done = ", ".join(f"{r.name} ({'skipped' if r.skipped else 'ran'})" for r in results)
    err.print(f"[green]run complete[/] in {out}: {done}")
    if any(r.name == "gate" for r in results):
        raise_unless_passed(RunLayout(out).stage("gate"))


@app.command()
@_guarded
def quantize(recipe: RecipeArg, out: OutOpt = Path("runs/latest")) -> None:
    """Quantize the target to MXFP4 with AMD Quark into OUT/quantize/checkpoint (resolving it first)."""
    from pipeline.entrypoints import run_pipeline

    run_pipeline(load_recipe(recipe), out, until="quantize")
    run = RunLayout(out)
    err.print(f"[green]quantized[/] -> {run.checkpoint} (report: {run.quantize_report})")


@app.command()
@_guarded
def pair(recipe: RecipeArg, out: OutOpt = Path("runs/latest")) -> None:
    """Check the drafter fits the target and is byte-for-byte unchanged; write the pair manifest."""
    from pipeline.entrypoints import run_pipeline

    run_pipeline(load_recipe(recipe), out, until="pair")
    err.print(f"[green]paired[/] -> {RunLayout(out).pair} (launch commands inside)")


@app.command()
@_guarded
def validate(recipe: RecipeArg, out: OutOpt = Path("runs/latest"), executor: ExecutorOpt = None,
             ray_address: RayAddressOpt = None) -> None:
    """Measure acceptance (bf16 vs MXFP4) and throughput; write OUT/validate/report.{json,md} and figures.
    Each server and each reference (precision, workload) is a cell, kept when finished: run again to resume."""
    from pipeline.entrypoints import run_pipeline
    from pipeline.run.artifacts import read_validate_report

    run_pipeline(_recipe_on(recipe, executor, ray_address), out, until="validate")
    run = RunLayout(out)
    report = read_validate_report(run.report)
    err.print(f"[green]validated[/]: {len(report.drift)} bf16-vs-MXFP4 drift rows -> {run.report_markdown} "
              f"(judge them with `mxspec gate {run.report}`)")


@app.command()
@_guarded
def gate(
    report: Annotated[Path, typer.Argument(help="OUT/validate/report.json of a validate run", show_default=False)],
    recipe: Annotated[Optional[Path], typer.Option("--recipe", "-r", help="take thresholds from this recipe "
                                                   "(default: the [gate] defaults)")] = None,
    out: Annotated[Optional[Path], typer.Option("--out", "-o", help="folder for verdict.json, summary.md, junit.xml "
                                                "(default: gate/ beside the report's folder)")] = None,
) -> None:
    """Decide pass/fail/inconclusive from a validation report. Exit 0 pass, 1 fail, 2 bad input.

    A cell fails only when its 95% interval lies beyond the threshold; `on_inconclusive` in the recipe
    decides what an undecided cell means. Writes a Markdown summary (for a CI job summary or PR comment)
    and JUnit XML with one test case per (workload, budget)."""
    from contextlib import nullcontext

    from pipeline.run.atomic import atomic_directory
    from pipeline.run.runner import hold_run_folder, is_run_folder
    from pipeline.stages.gate import ICON, gate_report, write_gate_outputs

    result = gate_report(report, load_recipe(recipe).gate if recipe else Gate())
    folder = Path(os.path.abspath(out or RunLayout(report.resolve().parent.parent).stage("gate")))
    # Inside a run folder, wait for no other mxspec run to hold it (the gate is one of its stages).
    with hold_run_folder(folder.parent) if is_run_folder(folder.parent) else nullcontext():
        with atomic_directory(folder) as tmp:
            write_gate_outputs(result, tmp)
    Console().print(f"gate {ICON[result.verdict]}: {sum(c.verdict == 'pass' for c in result.checks)}/"
                    f"{len(result.checks)} checks pass -> {escape(str(folder))}")
    raise typer.Exit(result.exit_code)


@app.command()
@_guarded
def publish(
    runs: Annotated[list[str], typer.Argument(help="RECIPE or RECIPE=OUT, one per checkpoint to publish "
                                              "(OUT defaults to --out)", show_default=False, metavar="RECIPE[=OUT]...")],
    out: OutOpt = Path("runs/latest"),
    dry_run: Annotated[bool, typer.Option("--dry-run", help="print what would be uploaded; change nothing")] = False,
    force: Annotated[bool, typer.Option("--force", help="publish even though the gate did not pass")] = False,
    create_pr: Annotated[bool, typer.Option("--create-pr", help="open a pull request instead of committing to main")] = False,
) -> None:
    """Upload validated checkpoints with their model cards to the Hub, then verify each upload.

    One commit per repo with the checkpoint, the card, figures and mxspec's reports; publishing the
    same files again makes no commit. Refuses a checkpoint whose gate did not pass unless --force.
    The drafter is never uploaded. Several RECIPE=OUT pairs make one publishing job with a summary.
    Token: HF_TOKEN or `hf auth login`; endpoint: the recipe's publish.endpoint, else HF_ENDPOINT, else huggingface.co."""
    from pipeline.jobs import publish_runs

    jobs = []
    for item in runs:
        recipe_path, _, run_out = item.partition("=")
        loaded = load_recipe(Path(recipe_path))
        if create_pr:
            loaded = loaded.model_copy(update={"publish": loaded.publish.model_copy(update={"create_pr": True})})
        jobs.append((loaded, Path(run_out) if run_out else out))
    outcomes = publish_runs(jobs, dry_run=dry_run, force=force, console=err)
    table = Table(title="dry run: nothing was uploaded" if dry_run else "publish summary", title_justify="left")
    for column in ("recipe", "repo", "result", "revision", "files"):
        table.add_column(column)
    for outcome in outcomes:
        table.add_row(*map(escape, outcome.row()))
    Console().print(table)
    failed = [o for o in outcomes if o.error]
    if failed:
        raise typer.Exit(max(o.exit_code for o in failed))


def main() -> None:
    app(prog_name="mxspec")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
