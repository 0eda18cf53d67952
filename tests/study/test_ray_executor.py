"""Validate's cells on Ray: a local cluster and a simulated two-node cluster measure what the local
executor measures, byte for byte; a worker killed mid-cell is run again; a failing cell is reported
with its log while the others are kept; a driver killed mid-study resumes with its finished cells."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import ray

from pipeline.entrypoints import run_pipeline
from pipeline.recipe import Cluster, load_recipe
from pipeline.study.cells import TIMING_FILE, Cell, CellStore, run_cells
from tests.conftest import ROOT, cli_env, copy_run, processes, validate_killed_once_a_cell_is_kept

pytestmark = [pytest.mark.slow, pytest.mark.ray]

ON_RAY = "[cluster]\nexecutor = 'ray'\n"  # device 'auto': CPUs, as these clusters have no GPU
BEFORE_VALIDATE = shutil.ignore_patterns("validate", "gate", "publish", "cells", "logs", "lock")


@pytest.fixture(scope="module")
def local(tmp_path_factory, tiny_reference_run):
    """The tiny reference study measured by the local executor; its recipe and its run folder (local/)."""
    folder = copy_run(tiny_reference_run, tmp_path_factory.mktemp("ray-cells"), out="local")
    (folder / "ray.toml").write_text((folder / "recipe.toml").read_text() + ON_RAY)
    return folder


def assert_same_study(run: Path, local: Path) -> None:
    """Report and every cell's result files equal the local executor's, byte for byte."""
    assert (run / "validate" / "report.json").read_bytes() == (local / "validate" / "report.json").read_bytes()
    cells = sorted(p.relative_to(local / ".mxspec" / "cells") for p in (local / ".mxspec" / "cells").rglob("*")
                   if p.is_file() and p.name != TIMING_FILE)  # its wall time and where it ran differ
    assert len({c.parts[0] for c in cells}) == 4
    for path in cells:
        assert (run / ".mxspec" / "cells" / path).read_bytes() == (local / ".mxspec" / "cells" / path).read_bytes(), path


def fresh_copy(local: Path, name: str) -> Path:
    """The local run up to pair, without its validate or cells: what a Ray study starts from."""
    out = local.parent / name
    shutil.copytree(local, out, ignore=BEFORE_VALIDATE)
    return out


def test_a_local_ray_cluster_measures_the_local_executors_study(local):
    assert not ray.is_initialized()
    out = fresh_copy(local / "local", "on-local-ray")
    results = {r.name: r for r in run_pipeline(load_recipe(local / "ray.toml"), out, until="validate")}
    assert not results["validate"].skipped
    assert_same_study(out, local / "local")
    assert not ray.is_initialized(), "the cluster mxspec started is stopped with the study"


def test_a_driver_killed_mid_study_resumes_with_its_finished_cells_untouched(local):
    out = fresh_copy(local / "local", "driver-killed")
    command = validate_killed_once_a_cell_is_kept(local / "ray.toml", out)
    cells = out / ".mxspec" / "cells"
    finished = [p for p in cells.rglob("*") if p.is_file() and p.parent.name != cells.name]
    before = {p: (p.stat().st_ino, p.stat().st_mtime_ns) for p in finished}
    assert before and not (out / "validate").exists()

    again = subprocess.run(command, env=cli_env(), cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "measured earlier (kept)" in again.stderr
    assert {p: (p.stat().st_ino, p.stat().st_mtime_ns) for p in before} == before
    assert_same_study(out, local / "local")


@pytest.fixture(scope="module")
def two_nodes(local):
    """A simulated two-node cluster (one CPU each), joined by this process."""
    from ray.cluster_utils import Cluster as RayCluster

    cluster = RayCluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    cluster.add_node(num_cpus=1)
    ray.init(address=cluster.address, include_dashboard=False, logging_level="WARNING")
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the test's own cells, for the workers
    yield cluster
    ray.shutdown()
    cluster.shutdown()


def test_two_nodes_measure_the_local_executors_study_on_both_nodes(local, two_nodes, capfd):
    import re

    from pipeline.run.runner import read_manifest

    out = fresh_copy(local / "local", "two-nodes")
    run_pipeline(load_recipe(local / "ray.toml"), out, until="validate")
    assert_same_study(out, local / "local")
    nodes = re.findall(r"reference-\S+: measured in \d+ s on node (\w+)", capfd.readouterr().err)
    assert len(nodes) == 4 and len(set(nodes)) == 2, nodes
    assert {f"cell reference-{p}-{w} (s)" for p in ("bf16", "mxfp4") for w in ("gsm8k", "humaneval")} <= \
        set(read_manifest(out / "validate").measured)


def test_a_worker_killed_mid_cell_is_run_again_and_the_study_completes(local, two_nodes):
    out = fresh_copy(local / "local", "worker-killed")
    killed, stop = [], threading.Event()

    def kill_the_first_cell_worker() -> None:
        while not stop.is_set() and not killed:
            for pid, title in processes("ray::reference-bf16-"):
                if title.startswith("ray::reference-bf16-"):
                    os.kill(pid, signal.SIGKILL)
                    killed.append(title)
                    break
            time.sleep(0.005)

    killer = threading.Thread(target=kill_the_first_cell_worker)
    killer.start()
    try:
        run_pipeline(load_recipe(local / "ray.toml"), out, until="validate")
    finally:
        stop.set()
        killer.join()
    assert killed, "no worker was seen measuring a bf16 cell"
    assert_same_study(out, local / "local")


def test_a_cell_that_fails_is_reported_with_its_log_and_the_other_cells_are_kept(tmp_path, two_nodes):
    from pipeline.errors import CellFailedError, ServerError
    from pipeline.study.ray_executor import RayExecutor

    def serves(work):
        (work.logs / "serve-good.log").write_text("served\n")
        (work.out / "result.json").write_text("{}")

    def dies(work):
        log = work.logs / "serve-bad.log"
        log.write_text("engine core died\n")
        raise ServerError(f"vLLM server died during the benchmark with exit code -9; log: {log}")

    store = CellStore(tmp_path / "cells", tmp_path / "logs")
    cells = [Cell("serve-good", "f", serves), Cell("serve-bad", "f", dies), Cell("reads-bad", "f", serves, after=("serve-bad",))]
    with pytest.raises(CellFailedError) as failed:
        run_cells(store, cells, RayExecutor(Cluster(executor="ray", device="cpu")))
    message = str(failed.value)
    assert failed.value.exit_code == 3 and failed.value.cell == "serve-bad" and "\n" not in message
    assert message.startswith("cell serve-bad failed on node ") and f"log: {tmp_path / 'logs' / 'serve-bad.log'}" in message
    assert "1 more failed: reads-bad" in message and "were kept" in message
    assert (tmp_path / "logs" / "serve-bad.log").read_text() == "engine core died\n"
    assert (tmp_path / "logs" / "serve-good.log").is_file() and store.finished(cells[0])
    assert not store.folder("serve-bad").exists() and not store.folder("reads-bad").exists()


def test_a_cell_no_node_can_hold_is_bad_input_not_a_hang(tmp_path, two_nodes):
    from pipeline.errors import BadInputError
    from pipeline.study.ray_executor import RayExecutor

    store = CellStore(tmp_path / "cells", tmp_path / "logs")
    with pytest.raises(BadInputError, match="needs 1 GPUs on one node but the largest node of the Ray cluster has 0; set \\[cluster\\] device"):
        run_cells(store, [Cell("serve-bf16-ar", "f", lambda work: None)], RayExecutor(Cluster(executor="ray", device="gpu")))
    with pytest.raises(BadInputError, match="needs 2 CPUs on one node but the largest node of the Ray cluster has 1"):
        run_cells(store, [Cell("reference-bf16-gsm8k", "f", lambda work: None)],
                  RayExecutor(Cluster(executor="ray", device="cpu", cpus_per_cell=2)))  # 2 CPUs in all, 1 a node


def test_shards_quantized_on_ray_are_the_bytes_of_local_file_to_file(tmp_path, tiny_fp8, two_nodes):
    """The tiny FP8 MoE target (two shards, one weight's scale in the other shard), quantized file-to-file
    here and as two Ray tasks (one per shard, on either node): every output file is identical, and both
    pass the bit-exact check."""
    from pipeline.quant.export import quantize_checkpoint
    from pipeline.recipe import Quantization

    source = tiny_fp8
    spec = Quantization(mode="file_to_file")
    here = quantize_checkpoint(source, tmp_path / "here", spec)
    on_ray = quantize_checkpoint(source, tmp_path / "on-ray", spec, cluster=Cluster(executor="ray", device="cpu"))
    files = sorted(p.name for p in (tmp_path / "here").iterdir())
    assert sum(name.endswith(".safetensors") for name in files) == 2
    assert files == sorted(p.name for p in (tmp_path / "on-ray").iterdir())
    for name in files:
        assert (tmp_path / "on-ray" / name).read_bytes() == (tmp_path / "here" / name).read_bytes(), name
    assert on_ray.quantized_layers == here.quantized_layers > 0
