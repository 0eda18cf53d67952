"""The study's progress on the terminal: one bar over every cell's steps, with an ETA, and a live line
per running cell (here or on a Ray worker)."""

from __future__ import annotations

from pipeline.study.cells import Cell, CellEvents, Measured

__all__ = ["CellProgress"]


class CellProgress(CellEvents):
    """An overall bar over every cell's steps (with an ETA) and one live line per running cell."""

    def __init__(self, progress, total_steps: int):
        self.progress, self.lines, self.reported = progress, {}, {}
        self.overall = progress.add_task("validate cells", total=total_steps)

    def kept(self, cell: Cell) -> None:
        self.progress.advance(self.overall, cell.steps)
        self.progress.console.print(f"  {cell.name}: measured earlier (kept)")

    def started(self, cell: Cell, where: str) -> None:
        if cell.name in self.lines:  # a Ray task started again after its worker died
            self.progress.reset(self.lines[cell.name])
            self.progress.advance(self.overall, -self.reported.pop(cell.name, 0))
        else:
            label = cell.name if where == "here" else f"{cell.name} on {where}"
            self.lines[cell.name] = self.progress.add_task(f"  {label}", total=cell.steps)

    def step(self, cell: Cell) -> None:
        if cell.name in self.lines:
            self.progress.advance(self.lines[cell.name])
        self.reported[cell.name] = self.reported.get(cell.name, 0) + 1
        self.progress.advance(self.overall)

    def finished(self, cell: Cell, measured: Measured) -> None:
        if (line := self.lines.pop(cell.name, None)) is not None:
            self.progress.remove_task(line)
        self.progress.advance(self.overall, max(cell.steps - self.reported.pop(cell.name, 0), 0))  # steps not reported
        where = "" if measured.where == "here" else f" on {measured.where}"
        self.progress.console.print(f"  {cell.name}: measured in {measured.seconds:.0f} s{where}")
