"""How this process reaches the Hugging Face Hub: the offline switch and a quick reachability probe.

Resolve (model downloads) and workloads (Hub prompt sets) both ask these questions; they read the
same `HF_HUB_OFFLINE` setting the Hub's own client reads, so one switch governs every Hub access.
"""

from __future__ import annotations

import os
from functools import lru_cache

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
