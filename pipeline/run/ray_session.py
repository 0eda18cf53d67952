"""Ray as mxspec uses it: joined or started once per run, and a plain map of jobs onto Ray tasks.

Quantize maps shards onto tasks that write to shared storage (`map_on_ray`); validate's cells run through
`study.ray_executor`, which builds on the same session. Ray is an optional extra: `import_ray` says how
to install it rather than failing with an ImportError."""

from __future__ import annotations

import os
from contextlib import contextmanager

from pipeline.errors import BadInputError, ExternalError
from pipeline.recipe import Cluster

__all__ = ["INSTALL", "import_ray", "ray_session", "map_on_ray"]

INSTALL = "pip install 'ray==2.60.0' (or `pip install -e '.[ray]'` in a checkout)"


def import_ray():
    """Ray, or one line saying how to install it (Ray is an optional extra of mxspec)."""
    try:
        import ray
    except ImportError:
        raise BadInputError(f"the ray executor needs Ray, which is not installed; {INSTALL}, "
                            "or use the local executor (--executor local)") from None
    return ray


@contextmanager
def ray_session(cluster: Cluster):
    """Ray, joined to the cluster [cluster] address or RAY_ADDRESS names (else one `ray start` runs on
    this machine, else a new local one); a cluster started here is stopped on the way out. A process
    already connected (a test, a notebook) keeps its connection."""
    ray = import_ray()
    if ray.is_initialized():
        yield ray
        return
    address = cluster.address or os.environ.get("RAY_ADDRESS") or None
    try:
        ray.init(address=address, include_dashboard=False, logging_level="WARNING", log_to_driver=True)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        where = f"the Ray cluster at {address}" if address else "a local Ray cluster"
        raise ExternalError(f"cannot start or join {where}: {str(exc).splitlines()[0][:200]}; "
                            "check [cluster] address or RAY_ADDRESS, and `ray status` on the head node") from None
    try:
        yield ray
    finally:
        ray.shutdown()


def map_on_ray(cluster: Cluster, fn, jobs: list[tuple], names: list[str]) -> list:
    """fn(*job) for each job as a Ray task reserving `cpus_per_cell` CPUs, results in order; a task whose
    worker died is run again up to `max_retries` times. For work that writes to shared storage."""
    with ray_session(cluster) as ray:
        remote = ray.remote(fn)
        refs = [remote.options(name=name, num_cpus=cluster.cpus_per_cell, max_retries=cluster.max_retries).remote(*job)
                for job, name in zip(jobs, names, strict=True)]
        try:
            return ray.get(refs)
        except KeyboardInterrupt:
            for ref in refs:
                ray.cancel(ref, force=True)
            raise
        except ray.exceptions.RayError as exc:
            cause = getattr(exc, "cause", None) or exc
            raise ExternalError(f"a Ray task failed: {cause.__class__.__name__}: {str(cause).splitlines()[0][:200]}") from None
