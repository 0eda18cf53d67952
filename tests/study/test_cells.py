"""The cell store: a finished cell is kept while its fingerprint holds, a half-measured one never counts."""

from __future__ import annotations

import pytest

from pipeline.study.cells import CELL_FILE, TIMING_FILE, Cell, CellEvents, CellStore, fingerprint, run_cells


def writing(text: str, calls: list[str]):
    def measure(work):
        calls.append(text)
        (work.out / "result.txt").write_text(text)
    return measure


class Recorded(CellEvents):
    def __init__(self):
        self.seen = []

    def kept(self, cell):
        self.seen.append(("kept", cell.name))

    def started(self, cell, where):
        self.seen.append(("started", cell.name))

    def step(self, cell):
        self.seen.append(("step", cell.name))

    def finished(self, cell, measured):
        self.seen.append(("finished", cell.name))


def test_a_finished_cell_is_kept_while_its_fingerprint_holds(tmp_path):
    store, calls = CellStore(tmp_path / "cells", tmp_path / "logs"), []
    cells = [Cell("a", fingerprint(x=1), writing("a1", calls)), Cell("b", fingerprint(x=2), writing("b1", calls))]
    run_cells(store, cells)
    first = (store.folder("a") / "result.txt").stat()
    events = Recorded()
    assert run_cells(store, cells, events=events) == {}
    assert calls == ["a1", "b1"] and events.seen == [("kept", "a"), ("kept", "b")]
    assert (store.folder("a") / "result.txt").stat().st_mtime_ns == first.st_mtime_ns
    run_cells(store, [Cell("a", fingerprint(x=3), writing("a2", calls)), cells[1]])  # what a read changed
    assert calls[-1] == "a2" and (store.folder("a") / "result.txt").read_text() == "a2"
    run_cells(store, cells, remeasure=True)
    assert calls[-2:] == ["a1", "b1"]


def test_a_cell_that_fails_leaves_nothing_and_the_next_run_measures_it(tmp_path):
    store, calls = CellStore(tmp_path / "cells", tmp_path / "logs"), []

    def broken(work):
        (work.out / "result.txt").write_text("half")
        raise RuntimeError("server died")

    with pytest.raises(RuntimeError):
        run_cells(store, [Cell("a", "f", writing("a", calls)), Cell("b", "f", broken)])
    assert (store.folder("a") / CELL_FILE).is_file() and not store.folder("b").exists()
    assert [p.name for p in store.root.iterdir()] == ["a"]
    run_cells(store, [Cell("a", "f", writing("a", calls)), Cell("b", "f", writing("b", calls))])
    assert calls == ["a", "b"]


def test_leftovers_of_a_killed_cell_are_swept_and_a_cell_without_its_record_is_not_finished(tmp_path):
    root = tmp_path / "cells"
    (root / ".a.tmp-1234abcd").mkdir(parents=True)
    (root / "b").mkdir()  # a folder without cell.json: not a finished cell
    store = CellStore(root, tmp_path / "logs")
    assert not (root / ".a.tmp-1234abcd").exists()
    assert not store.finished(Cell("b", "f", writing("b", [])))


def test_the_stage_links_the_cells_it_used(tmp_path):
    store = CellStore(tmp_path / "cells", tmp_path / "logs")
    run_cells(store, [Cell("a", "f", writing("a", []))])
    store.link_into(["a"], tmp_path / "validate" / "cells")
    linked = tmp_path / "validate" / "cells" / "a"
    assert sorted(p.name for p in linked.iterdir()) == [CELL_FILE, "result.txt"], "its timing differs run to run: not linked"
    assert (store.folder("a") / TIMING_FILE).is_file()
    assert (linked / "result.txt").stat().st_ino == (store.folder("a") / "result.txt").stat().st_ino


def test_a_cell_reads_the_cells_it_comes_after_and_reports_its_steps_and_phases(tmp_path):
    store = CellStore(tmp_path / "cells", tmp_path / "logs")

    def texts(work):
        (work.out / "texts.txt").write_text("bf16 text")
        with work.timed("generate"):
            work.step()
        work.step()

    def verify(work):
        assert work.inputs == {"texts": store.folder("texts")}
        (work.out / "verified.txt").write_text((work.inputs["texts"] / "texts.txt").read_text() + " verified")
        (work.logs / "verify.log").write_text("kept even when a cell fails")

    events = Recorded()
    measured = run_cells(store, [Cell("texts", "f", texts, steps=2), Cell("verify", "f", verify, after=("texts",))],
                         events=events)
    assert (store.folder("verify") / "verified.txt").read_text() == "bf16 text verified"
    assert (tmp_path / "logs" / "verify.log").is_file()
    assert events.seen == [("started", "texts"), ("step", "texts"), ("step", "texts"), ("finished", "texts"),
                           ("started", "verify"), ("finished", "verify")]
    assert set(measured) == {"texts", "verify"} and set(measured["texts"].phases) == {"generate"}
    assert measured["texts"].seconds >= measured["texts"].phases["generate"] >= 0 and measured["texts"].where == "here"
    assert store.timing("texts") == measured["texts"], "kept beside the cell, for `mxspec plan --run`"
