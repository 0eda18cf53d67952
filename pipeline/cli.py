"""The `mxspec` command line: a thin layer over the stage entry points.

Exit codes: 0 ok, 1 gate failed, 2 bad input, 3 an external component failed.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import traceback
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from pipeline.errors import MxspecError, NotYetImplementedError
from pipeline.recipe import Recipe, load_recipe

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

RecipeArg = Annotated[Path, typer.Argument(help="recipe TOML file, e.g. recipes/reference-cpu.toml", show_default=False)]
OutOpt = Annotated[Path, typer.Option("--out", "-o", help="output folder; one subfolder per stage")]


def _guarded(command):
    """Turn expected failures into one line on stderr and their exit code; no traceback."""

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except MxspecError as exc:
            err.print(f"[red]error:[/] {exc}", markup=True)
            raise typer.Exit(exc.exit_code) from None
        except KeyboardInterrupt:
            err.print("[red]interrupted[/]; run the same command again to resume")
            raise typer.Exit(130) from None
        except Exception as exc:  # a bug: say so in one line, keep the traceback behind a switch
            if os.environ.get("MXSPEC_TRACEBACK"):
                traceback.print_exc()
            err.print(f"[red]internal error:[/] {exc.__class__.__name__}: {exc} (set MXSPEC_TRACEBACK=1 for details)")
            raise typer.Exit(3) from None

    return wrapper


def _pending(command: str) -> None:
    from pipeline.stages import PENDING

    raise NotYetImplementedError(f"`mxspec {command}` has not landed yet (tracked in issue {PENDING[command]})")


@recipe_app.command("check")
@_guarded
def recipe_check(recipe: RecipeArg) -> None:
    """Validate a recipe and print what it will run. Exit 2 with one line per problem."""
    loaded = load_recipe(recipe)
    Console().print(_recipe_table(recipe, loaded))


def _recipe_table(path: Path, recipe: Recipe) -> Table:
    v, q = recipe.validation, recipe.quantization
    table = Table(title=f"{path}: ok", show_header=False, title_justify="left")
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
        "serving env": " ".join(f"{k}={v_}" for k, v_ in recipe.serving.env.items()) or "-",
        "publish": recipe.publish.repo_id or "-",
    }
    for key, value in rows.items():
        table.add_row(key, value)
    return table


@app.command()
@_guarded
def run(
    recipe: RecipeArg,
    out: OutOpt = Path("runs/latest"),
    force: Annotated[list[str], typer.Option("--force", help="redo this stage even if up to date (repeatable)")] = [],
) -> None:
    """Run every stage in order into OUT, resuming: stages already done are skipped."""
    from pipeline.stages import PENDING, run_pipeline

    results = run_pipeline(load_recipe(recipe), out, force=tuple(force))
    done = ", ".join(f"{r.name} ({'skipped' if r.skipped else 'ran'})" for r in results)
    err.print(f"[green]run complete[/] in {out}: {done}")
    if PENDING:
        err.print(f"not landed yet: {', '.join(PENDING)}")


@app.command()
@_guarded
def quantize(recipe: RecipeArg, out: OutOpt = Path("runs/latest")) -> None:
    """Quantize the target to MXFP4 with AMD Quark into OUT/quantize/checkpoint (resolving it first)."""
    from pipeline.stages import run_pipeline

    run_pipeline(load_recipe(recipe), out, until="quantize")
    err.print(f"[green]quantized[/] -> {out / 'quantize' / 'checkpoint'} (report: {out / 'quantize' / 'mxspec-quantize.json'})")


@app.command()
@_guarded
def pair(recipe: RecipeArg, out: OutOpt = Path("runs/latest")) -> None:
    """Check the drafter fits the target and is byte-for-byte unchanged; write the pair manifest."""
    from pipeline.stages import run_pipeline

    run_pipeline(load_recipe(recipe), out, until="pair")
    err.print(f"[green]paired[/] -> {out / 'pair' / 'pair.json'} (launch commands inside)")


@app.command()
@_guarded
def validate(recipe: RecipeArg, out: OutOpt = Path("runs/latest")) -> None:
    """Measure acceptance (bf16 vs MXFP4) and throughput; write OUT/validate/report.{json,md} and figures."""
    from pipeline.stages import run_pipeline

    results = run_pipeline(load_recipe(recipe), out, until="validate")
    report = json.loads((results[-1].path / "report.json").read_text())
    err.print(f"[green]validated[/]: verdict {report['verdict']} -> {out / 'validate' / 'report.md'}")


@app.command()
@_guarded
def gate(report: Annotated[Path, typer.Argument(help="validate report.json")]) -> None:
    """Decide pass/fail/inconclusive from a validation report; exit 0 pass, 1 fail."""
    _pending("gate")


@app.command()
@_guarded
def publish(recipe: RecipeArg, out: OutOpt = Path("runs/latest")) -> None:
    """Upload the quantized checkpoint with its model card to the Hub, then verify the upload."""
    _pending("publish")


def main() -> None:
    app(prog_name="mxspec")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
