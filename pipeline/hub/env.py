"""How this process reaches the Hugging Face Hub: the offline switch, a quick reachability probe, the
endpoint and the token.

Resolve (model downloads) and workloads (Hub prompt sets) both ask these questions; they read the
same `HF_HUB_OFFLINE` setting the Hub's own client reads, so one switch governs every Hub access.
"""

from __future__ import annotations

import os
from functools import lru_cache

from pipeline.errors import BadInputError

__all__ = ["hub_offline", "hub_reachable", "DEFAULT_ENDPOINT", "hub_endpoint", "hub_token"]

_TRUE = {"1", "ON", "YES", "TRUE"}


def hub_offline() -> bool:
    """True when `HF_HUB_OFFLINE` is set, in the environment or in the Hub client's constants."""
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE) or os.environ.get("HF_HUB_OFFLINE", "").upper() in _TRUE


@lru_cache(maxsize=None)
def hub_reachable(endpoint: str, timeout: float = 3.0) -> bool:
    """One quick probe per endpoint and process, so an offline machine fails fast instead of waiting
    on a client's retries. Any HTTP answer counts as reachable."""
    import urllib.error
    import urllib.request

    try:
        urllib.request.urlopen(urllib.request.Request(endpoint, method="HEAD"), timeout=timeout).close()
        return True
    except urllib.error.HTTPError:
        return True
    except (urllib.error.URLError, OSError, ValueError):
        return False


DEFAULT_ENDPOINT = "https://huggingface.co"


def hub_endpoint(configured: str | None = None) -> str:
    """The Hub to publish to: the recipe's [publish] endpoint, else HF_ENDPOINT (as huggingface_hub reads
    it), else the public Hub."""
    return (configured or os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/")


def hub_token() -> str:
    """The token from HF_TOKEN or `hf auth login`; one line on how to provide it when there is none."""
    from huggingface_hub import get_token

    token = get_token()
    if not token:
        raise BadInputError("no Hugging Face token: set HF_TOKEN or run `hf auth login` (or stop before publishing "
                            "with `mxspec run RECIPE --until gate`)")
    return token
