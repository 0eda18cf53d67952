"""OpenAI-compatible client for the benchmark: greedy chat completions, prompt scoring and /metrics snapshots."""

from __future__ import annotations

import json
import re
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from pipeline.errors import ServerError

__all__ = ["Completion", "chat", "TopLogprobs", "score", "run_requests", "scrape_metrics"]

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
    prompt_token_ids: tuple[int, ...] | None = None  # the chat-templated prompt as the server tokenized it
    speculative: dict | None = None  # vLLM's per-request `metrics.speculative_decoding`, where the server reports it


def _post(url: str, payload: dict, timeout: float) -> dict:
    request = urllib.request.Request(
        url, data=json.dumps(payload).encode(), headers={"Content-Type": "application/json"}, method="POST"
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as exc:
        body = exc.read().decode(errors="replace")[:300]
        raise ServerError(f"{url} answered HTTP {exc.code}: {body}", url=url) from exc
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError) as exc:
        raise ServerError(f"{url} did not answer ({exc.__class__.__name__}: {exc}); did the server die?", url=url) from exc


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
        prompt_token_ids=tuple(answer["prompt_token_ids"]) if answer.get("prompt_token_ids") else None,
        speculative=(answer.get("metrics") or {}).get("speculative_decoding"),
    )


TopLogprobs = dict[int, float]  # token id -> log-probability, the server's top-k at one position


def score(base_url: str, model: str, token_ids: list[int], top_k: int, timeout: float = 600.0) -> list[TopLogprobs | None]:
    """The served model's top-`top_k` next-token log-probabilities at every position of `token_ids`,
    teacher forced: one prefill (vLLM's `prompt_logprobs`). Entry i is the distribution of token i given
    tokens before it (the first is None); each entry also holds the logprob of the token actually there."""
    payload = {"model": model, "prompt": list(token_ids), "max_tokens": 1, "temperature": 0.0,
               "prompt_logprobs": top_k}
    answer = _post(f"{base_url}/v1/completions", payload, timeout)
    rows = answer["choices"][0].get("prompt_logprobs")
    if rows is None or len(rows) != len(token_ids):
        raise ServerError(f"{base_url} returned no prompt_logprobs for {len(token_ids)} tokens; "
                          "does this vLLM support prompt_logprobs?", url=f"{base_url}/v1/completions")
    return [None if row is None else {int(t): float(v["logprob"]) for t, v in row.items()} for row in rows]


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
        raise ServerError(f"{base_url}/metrics did not answer ({exc.__class__.__name__}); did the server die?",
                          url=f"{base_url}/metrics") from exc
    samples = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        match = _SAMPLE.match(line)
        if match:
            labels = tuple(sorted(_LABEL.findall(match["labels"] or "")))
            samples[(match["name"], labels)] = float(match["value"])
    return samples
