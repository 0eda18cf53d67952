"""OpenAI-compatible client for the benchmark: greedy chat completions and /metrics snapshots."""

from __future__ import annotations

import json
import re
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from pipeline.serving.server import ServerError

_SAMPLE = re.compile(r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>[^}]*)\})?\s+(?P<value>\S+)")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


@dataclass(frozen=True)
class Completion:
    prompt_id: str
    text: str
    token_ids: tuple[int, ...] | None
    output_tokens: int
    latency_s: float
    finish_reason: str


def _post(url: str, payload: dict, timeout: float) -> dict:
    request = urllib.request.Request(
        url, data=json.dumps(payload).encode(), headers={"Content-Type": "application/json"}, method="POST"
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as exc:
        body = exc.read().decode(errors="replace")[:300]
        raise ServerError(f"{url} answered HTTP {exc.code}: {body}") from exc
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError) as exc:
        raise ServerError(f"{url} did not answer ({exc.__class__.__name__}: {exc}); did the server die?") from exc


def chat(base_url: str, model: str, prompt_id: str, text: str, max_tokens: int, timeout: float = 600.0) -> Completion:
    """One greedy chat completion; the output token ids come back too (vLLM's return_token_ids)."""
    payload = {
        "model": model,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "top_p": 1.0,
        "top_k": 1,
        "seed": 0,
        "return_token_ids": True,
    }
    started = time.perf_counter()
    answer = _post(f"{base_url}/v1/chat/completions", payload, timeout)
    latency = time.perf_counter() - started
    choice = answer["choices"][0]
    token_ids = choice.get("token_ids")
    return Completion(
        prompt_id=prompt_id,
        text=choice["message"]["content"] or "",
        token_ids=tuple(token_ids) if token_ids is not None else None,
        output_tokens=int(answer["usage"]["completion_tokens"]),
        latency_s=latency,
        finish_reason=choice.get("finish_reason") or "",
    )


def run_requests(
    base_url: str, model: str, prompts: list[tuple[str, str]], max_tokens: int, concurrency: int, timeout: float = 600.0
) -> tuple[list[Completion], float]:
    """Send every (id, text) with `concurrency` in flight; returns completions in order and wall time."""
    started = time.perf_counter()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        futures = [pool.submit(chat, base_url, model, pid, text, max_tokens, timeout) for pid, text in prompts]
        completions = [future.result() for future in futures]
    return completions, time.perf_counter() - started


def scrape_metrics(base_url: str, timeout: float = 30.0) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Prometheus text exposition -> {(name, sorted labels): value}."""
    try:
        with urllib.request.urlopen(f"{base_url}/metrics", timeout=timeout) as response:
            text = response.read().decode()
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError) as exc:
        raise ServerError(f"{base_url}/metrics did not answer ({exc.__class__.__name__}); did the server die?") from exc
    samples = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        match = _SAMPLE.match(line)
        if match:
            labels = tuple(sorted(_LABEL.findall(match["labels"] or "")))
            samples[(match["name"], labels)] = float(match["value"])
    return samples
