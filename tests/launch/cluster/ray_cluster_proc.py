"""A Ray cluster of two logical nodes for the Ray backend's tests, run in its own process.

``python ray_cluster_proc.py`` starts a head ('verifier-box', resource h100) and one more node
('edge-1', resource l4), prints ``{"address": ...}`` as one line, and keeps the cluster up until its
stdin closes; then it shuts the cluster down and exits.

Why a process of its own: Ray starts each of its processes with a ``preexec_fn``, Python run in the
forked child before it execs. In a process with other threads (the test session holds gRPC threads
left by earlier tests, and torch's) such a child can hang or abort before its exec. In three full
test runs a Ray process never started and left no log: the head's raylet (2026-11-25), the head's
GCS server (2026-11-26), the second node's raylet (2026-11-27). Here the only threads are Ray's.
A node that does not come up within Ray's 30 s is still tried again, up to three times.
"""

import json
import sys
import warnings

ATTEMPTS = 3
HEAD = {"num_cpus": 4, "resources": {"h100": 1}, "node_name": "verifier-box", "object_store_memory": 80 * 2**20,
        "include_dashboard": False}
EDGE = {"num_cpus": 8, "resources": {"l4": 4}, "node_name": "edge-1", "object_store_memory": 80 * 2**20}


def _startup_failure(e: Exception) -> bool:
    return "timed out during startup" in str(e) or "Timed out waiting for file" in str(e)


def _with_retries(what: str, start):
    for attempt in range(1, ATTEMPTS + 1):
        try:
            return start()
        except Exception as e:  # Ray raises a bare Exception for a node that does not come up
            if not _startup_failure(e) or attempt == ATTEMPTS:
                raise
            warnings.warn(f"Ray's {what} did not start (attempt {attempt}): {e}")


def main() -> None:
    from ray.cluster_utils import Cluster

    cluster = _with_retries("head node", lambda: Cluster(initialize_head=True, connect=False, head_node_args=HEAD))
    try:
        _with_retries("second node", lambda: cluster.add_node(**EDGE))
        print(json.dumps({"address": cluster.address}), flush=True)
        sys.stdin.read()  # until the test session closes our stdin (or ends)
    finally:
        cluster.shutdown()


if __name__ == "__main__":
    main()
