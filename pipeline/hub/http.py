"""How mxspec talks HTTP to the Hub: time limits, retries, and errors turned into one line.

Every request has a time limit (MXSPEC_HUB_TIMEOUT_S, default 300 s per read or write): huggingface_hub's
shared client waits forever on a silent server otherwise. Reads, `create_repo(exist_ok)`, tags and LFS
uploads are retried on 408/429/5xx and dropped connections, waiting as long as a 429's Retry-After asks.
Failures become `HubError`s that name the repo and status and never contain the token."""

from __future__ import annotations

import os
import time

from pipeline.errors import BadInputError, GateFailedError, HubError

__all__ = ["RETRY_STATUSES", "ATTEMPTS", "BACKOFF_S", "retryable", "wait_s", "retried", "configure_hub_client",
    "hub_timeout_s", "hub_errors"]

RETRY_STATUSES = (408, 429, 500, 502, 503, 504)


ATTEMPTS = 5  # per step: the first try and four retries


BACKOFF_S = (1.0, 2.0, 4.0, 8.0)


def retryable(exc: BaseException) -> bool:
    """A fault worth another try: 408/429/5xx, or the connection failed or timed out."""
    from huggingface_hub.errors import HfHubHTTPError

    if isinstance(exc, HfHubHTTPError):
        return exc.response is not None and exc.response.status_code in RETRY_STATUSES
    return isinstance(exc, _transport_errors())


def wait_s(exc: BaseException, attempt: int) -> float:
    """A 429's Retry-After (seconds), else exponential backoff."""
    response = getattr(exc, "response", None)
    value = response.headers.get("Retry-After", "") if response is not None else ""
    return float(value) if value.strip().isdigit() else BACKOFF_S[min(attempt, len(BACKOFF_S) - 1)]


def retried(call):
    """`call()`, tried again on a retryable fault; only for steps that are safe to repeat."""
    for attempt in range(ATTEMPTS):
        try:
            return call()
        except Exception as exc:
            if attempt == ATTEMPTS - 1 or not retryable(exc):
                raise
            time.sleep(wait_s(exc, attempt))
    raise AssertionError("unreachable")


def configure_hub_client() -> None:
    """Give huggingface_hub's shared HTTP client time limits (its default waits forever on a silent server)."""
    import httpx2
    from huggingface_hub import set_client_factory
    from huggingface_hub.utils._http import default_client_factory

    limit_s = hub_timeout_s()

    def factory():
        client = default_client_factory()
        client.timeout = httpx2.Timeout(limit_s, connect=min(limit_s, 30.0))
        return client

    set_client_factory(factory)


def hub_timeout_s() -> float:
    raw = os.environ.get("MXSPEC_HUB_TIMEOUT_S", "300")
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 0 < value < float("inf"):
        raise BadInputError(f"MXSPEC_HUB_TIMEOUT_S={raw!r} is not a positive number of seconds; unset it or set e.g. 300")
    return value


def _transport_errors() -> tuple[type[BaseException], ...]:
    """The HTTP client errors huggingface_hub may raise: httpx's, or httpx2's (huggingface_hub >= 2.4)."""
    import importlib

    found = []
    for module in ("httpx", "httpx2"):
        try:
            found.append(importlib.import_module(module).HTTPError)
        except ImportError:
            continue
    return tuple(found)


class hub_errors:
    """Turn client and HTTP failures into one-line HubErrors that never contain the token."""

    def __init__(self, endpoint: str, repo_id: str, token: str):
        self.endpoint, self.repo_id, self.token = endpoint, repo_id, token

    def __enter__(self):
        return self

    def __exit__(self, kind, exc, tb):
        if exc is None or isinstance(exc, (BadInputError, GateFailedError, HubError)):
            return False
        from huggingface_hub.errors import HfHubHTTPError

        if isinstance(exc, HfHubHTTPError):
            status = exc.response.status_code if exc.response is not None else None
            first = str(exc).splitlines()[0] if str(exc) else exc.__class__.__name__
            if status in (401, 403):
                message = f"the Hub at {self.endpoint} refused the token ({status}); check HF_TOKEN's write access to {self.repo_id}"
            else:
                message = f"the Hub at {self.endpoint} answered {status or '?'}: {first}"
            raise HubError(message.replace(self.token, "***"), repo_id=self.repo_id, status=status) from None
        if "Timeout" in exc.__class__.__name__:
            message = (f"the Hub at {self.endpoint} did not answer within {hub_timeout_s():g} s, "
                       f"{ATTEMPTS} times; try again later, or raise MXSPEC_HUB_TIMEOUT_S")
        elif isinstance(exc, (*_transport_errors(), OSError)):
            message = f"cannot reach the Hub at {self.endpoint} ({exc.__class__.__name__}); check the network or HF_ENDPOINT"
        else:
            return False
        raise HubError(message.replace(self.token, "***"), repo_id=self.repo_id) from None
