"""``goodspeed launch --backend ray``: the local backend's cluster, placed on the nodes of a Ray cluster.

Ray (https://docs.ray.io) does the cross-machine work: it knows the nodes and their resources,
starts a process on the node we choose, and carries calls and bytes between machines. GoodSpeed
adds placement by the spec's keys and the same processes, logs, live table and summary as
:mod:`goodspeed.launch.cluster.local`:

1. Connect to an existing cluster (``--address``; ``auto`` reads ``RAY_ADDRESS`` or finds the head
   started on this machine). The launcher never starts a cluster of its own.
2. Plan: each process (the verifier first, then the drafters in spec order) asks for a
   :class:`~goodspeed.launch.spec.Placement` (``num_cpus``, ``num_gpus``, ``resources``, ``node``).
   It goes to an alive node whose resources cover the request after what this launch already put
   there; drafters prefer nodes other than the verifier's, then the least-loaded (they spread over
   the edge devices). A request no node
   can meet fails here, naming the process and what the nodes offer, before anything starts:
   never a pending actor waiting forever. ``--dry-run`` prints the plan and stops.
3. One :class:`ProcessHost` actor per process, pinned to its planned node and reserving the
   requested resources there. If the node's resources are busy with other work, the launch fails
   after ``ready_timeout_s`` saying so.
4. Embedded models (``demo:``, ``real:``) are built where they are needed, once per machine (its processes share the
   model cache), machines in parallel.
5. The verifier's actor runs ``goodspeed verifier`` bound to its node's IP (the address Ray itself
   uses between nodes; a spec's non-loopback ``host``, e.g. ``0.0.0.0``, is kept) on the spec's
   ``port`` or a free one; the launcher reads the port from the log it pulls back and gives every
   drafter ``NODE_IP:PORT``. Each drafter's actor writes its prompt file (sent from the
   launching machine, so a local JSONL path works) and runs ``goodspeed drafter``.
6. A pump thread pulls every process's log, and each drafter's results, into ``OUT/`` every
   0.25 s; the verifier's log feeds the same live table as the local backend.
7. Teardown (drafters done, Ctrl-C, or an error): drafters get SIGTERM, then the verifier (it
   drains), a last pull, and the actors are killed. Children die with their actor
   (``PR_SET_PDEATHSIG``), and Ray kills a launcher's actors when the launcher exits, so a
   killed launcher leaves nothing running either.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, replace
from pathlib import Path

from goodspeed.launch.cluster.local import (
    CLI, LaunchError, LocalCluster, _pinned, _prompt_file, _tail, apply_line, drafter_command, run_cluster, verifier_command,
    with_run_credentials,
)
from goodspeed.launch.spec import DrafterSpec, LaunchSpec, Placement, VerifierSpec, placement_of
from goodspeed.verifier.auth import write_private

PULL_S = 0.25
# Credential fields of each spec whose files travel to the process's node (when this launch made them).
VERIFIER_FILES = ("tls_cert", "tls_key", "tls_client_ca", "auth_tokens")
DRAFTER_FILES = ("tls_ca", "tls_cert", "tls_key", "token_file")


class PlacementError(LaunchError):
    """No node of the Ray cluster can run a process as the spec asks."""


@dataclass(frozen=True)
class NodeInfo:
    node_id: str
    name: str
    ip: str
    total: dict[str, float]
    head: bool = False

    def label(self) -> str:
        return f"{self.name} ({self.ip}, {self.node_id[:8]})" if self.name != self.ip else f"{self.ip} ({self.node_id[:8]})"

    def offers(self) -> str:
        shown = {k: v for k, v in self.total.items() if not k.startswith("node:") and k not in ("memory", "object_store_memory")}
        return ", ".join(f"{k} {v:g}" for k, v in sorted(shown.items())) or "no resources"


@dataclass(frozen=True)
class Assignment:
    name: str
    role: str  # verifier | drafter
    placement: Placement
    node: NodeInfo


def _matches(node: NodeInfo, want: str) -> bool:
    return want in (node.name, node.ip) or (len(want) >= 6 and node.node_id.startswith(want))


def _describe_nodes(nodes: list[NodeInfo]) -> str:
    return "; ".join(f"{n.label()}: {n.offers()}" for n in nodes)


def plan_placement(spec: LaunchSpec, nodes: list[NodeInfo]) -> list[Assignment]:
    """Where each process of ``spec`` runs; :class:`PlacementError` when one cannot run anywhere."""
    if not nodes:
        raise PlacementError("the Ray cluster has no alive nodes")
    used: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    users: dict[str, list[str]] = defaultdict(list)
    plan = []
    processes: list[tuple[str, str, VerifierSpec | DrafterSpec]] = [("verifier", "verifier", spec.verifier)]
    processes += [("drafter", d.name, d) for d in spec.expanded_drafters()]
    for role, name, proc in processes:
        what = "the verifier" if role == "verifier" else f"drafter {name!r}"
        want = placement_of(proc)
        if proc.device.startswith("cuda") and want.num_gpus < 1:
            raise PlacementError(f"{what}: device {proc.device!r} needs num_gpus >= 1 (Ray shows a process only the GPUs it reserves)")
        candidates = [n for n in nodes if want.node is None or _matches(n, want.node)]
        if not candidates:
            raise PlacementError(f"{what} asks for node {want.node!r}, which is no alive node's name, IP or ID; nodes: {_describe_nodes(nodes)}")
        demand = want.demand()
        offering = [n for n in candidates if all(n.total.get(k, 0.0) >= v for k, v in demand.items())]
        if not offering:
            missing = ", ".join(f"{k} {v:g}" for k, v in demand.items() if not any(n.total.get(k, 0.0) >= v for n in candidates))
            lacking = missing or "all of it at once"
            why = f"node {want.node!r} does not offer {lacking}" if want.node else f"no node offers {lacking}"
            raise PlacementError(f"{what} asks for {want.describe()}, but {why}; nodes: {_describe_nodes(candidates)}")
        free = [n for n in offering if all(n.total.get(k, 0.0) - used[n.node_id][k] >= v - 1e-9 for k, v in demand.items())]
        if not free:
            taken = "; ".join(f"{n.label()} runs {', '.join(users[n.node_id])}" for n in offering)
            raise PlacementError(f"{what} asks for {want.describe()}: every node offering it is already used by this launch ({taken})")
        # Drafters keep off the verifier's node where they can and spread over the rest; ties keep the nodes' order.
        node = min(free, key=lambda n: (role == "drafter" and "verifier" in users[n.node_id], len(users[n.node_id])))
        for k, v in demand.items():
            used[node.node_id][k] += v
        users[node.node_id].append(name)
        plan.append(Assignment(name, role, want, node))
    return plan


def placement_rows(plan: list[Assignment]) -> dict[str, dict]:
    """The plan as JSON-able rows (the summary's ``placement``)."""
    return {a.name: {"role": a.role, "asks": a.placement.describe(), "node": a.node.name, "ip": a.node.ip, "node_id": a.node.node_id}
            for a in plan}


def format_plan(plan: list[Assignment]) -> list[str]:
    lines = [f"  {'process':<16} {'asks':<28} node"]
    lines += [f"  {a.name:<16} {a.placement.describe():<28} {a.node.label()}" for a in plan]
    return lines


# --- on the node ---------------------------------------------------------------------------------


def _read_from(path: Path, offset: int, final: bool) -> bytes:
    """Bytes of ``path`` after ``offset``: whole lines only unless the writer has exited."""
    if not path.exists():
        return b""
    with open(path, "rb") as f:
        f.seek(offset)
        data = f.read()
    return data if final else data[: data.rfind(b"\n") + 1]


class ProcessHost:
    """One goodspeed process on the node Ray placed this actor on; hands back its log and results.

    Runs as a Ray actor (``max_concurrency=1``: every method runs on the actor's main thread, which
    lives as long as the actor, so the child's ``PR_SET_PDEATHSIG`` fires only when the actor dies).
    """

    def __init__(self, name: str) -> None:
        import ray

        self.name = name
        self.ip = ray.util.get_node_ip_address()
        self.node_id = ray.get_runtime_context().get_node_id()
        self.workdir = Path(tempfile.mkdtemp(prefix=f"goodspeed-{name}-"))
        self.log_path = self.workdir / f"{name}.log"
        self.out_path = self.workdir / f"{name}.jsonl"
        self.proc: subprocess.Popen | None = None

    def where(self) -> dict:
        return {"ip": self.ip, "node_id": self.node_id, "hostname": socket.gethostname(), "python": sys.executable, "workdir": str(self.workdir)}

    def prepare_models(self, families: list[str]) -> tuple[int, str]:
        """Build (or check) embedded models on this node (``demo``, ``smollm2-135m``, ...); the
        output goes to the process log."""
        with open(self.log_path, "a", encoding="utf-8") as log:
            rc = subprocess.run(CLI + ["models", "get", *families, "--quiet"], stdout=log, stderr=log).returncode
        return rc, _tail(self.log_path)

    def _with_files(self, spec, files: dict[str, str]):
        """Write credential files the launcher made (spec field -> PEM or token text) into this
        node's work dir (0600) and point the spec's fields at them."""
        paths = {}
        for field_name, text in files.items():
            path = self.workdir / f"{self.name}.{field_name}"
            write_private(path, text)
            paths[field_name] = str(path)
        return replace(spec, **paths)

    def start_verifier(self, spec: VerifierSpec, files: dict[str, str] | None = None) -> None:
        # Loopback (the spec default) is unreachable from other nodes: bind the node's Ray IP instead.
        host = self.ip if spec.host in ("127.0.0.1", "localhost", "::1") else spec.host
        spec = self._with_files(replace(spec, host=host), files or {})
        self._start(verifier_command(spec, self.workdir), spec.cpus, spec.num_cpus)

    def start_drafter(self, spec: DrafterSpec, address: str, prompts: str, files: dict[str, str] | None = None) -> None:
        path = self.workdir / f"{spec.name}.prompts.jsonl"
        path.write_text(prompts, encoding="utf-8")
        spec = self._with_files(spec, files or {})
        self._start(drafter_command(spec, address, path, self.out_path, self.workdir), spec.cpus, spec.num_cpus)

    def _start(self, cmd: list[str], cpus: tuple[int, ...] | None, num_cpus: float) -> None:
        with open(self.log_path, "a", encoding="utf-8") as log:
            cmd, pinning = _pinned(cmd, cpus, threads=max(1, int(num_cpus)), die_with_parent=True)
            self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log, **pinning)

    def read(self, log_offset: int, out_offset: int) -> tuple[bytes, bytes, int | None]:
        returncode = self.proc.poll() if self.proc is not None else None  # first: after exit the files are complete
        final = returncode is not None
        return _read_from(self.log_path, log_offset, final), _read_from(self.out_path, out_offset, final), returncode

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)

    def wait(self, timeout_s: float) -> int | None:
        if self.proc is None:
            return None
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(5)

    def cleanup(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5)
        shutil.rmtree(self.workdir, ignore_errors=True)


# --- on the launching machine --------------------------------------------------------------------


class RemoteProcess:
    """The launcher's handle on a process under a :class:`ProcessHost` (``poll``/``returncode``
    like ``subprocess.Popen``, so the local backend's table and summary work unchanged)."""

    def __init__(self, host, name: str, log_path: Path, out_path: Path | None = None, on_line=None) -> None:
        self.host, self.name, self.on_line = host, name, on_line
        self.log_path, self.out_path = log_path, out_path
        self.log_offset = self.out_offset = 0
        self.returncode: int | None = None
        self._final = False  # the process has exited and everything it wrote is here
        log_path.write_bytes(b"")
        if out_path is not None:
            out_path.write_bytes(b"")

    def poll(self) -> int | None:
        return self.returncode

    def pull(self, timeout_s: float = 30.0) -> None:
        import ray

        if self._final:
            return
        try:
            log, out, returncode = ray.get(self.host.read.remote(self.log_offset, self.out_offset), timeout=timeout_s)
        except ray.exceptions.RayActorError as exc:  # the node or the actor died: the process is gone
            with open(self.log_path, "a", encoding="utf-8") as f:
                f.write(f"\n[goodspeed launch] lost the Ray actor running {self.name}: {exc}\n")
            self.returncode, self._final = -1, True
            return
        with open(self.log_path, "ab") as f:
            f.write(log)
        if out and self.out_path is not None:
            with open(self.out_path, "ab") as f:
                f.write(out)
        self.log_offset += len(log)
        self.out_offset += len(out)
        if self.on_line is not None:
            for line in log.decode("utf-8", errors="replace").splitlines():
                self.on_line(line)
        self.returncode = returncode  # last: once set, the files here are complete
        self._final = returncode is not None


class RayCluster(LocalCluster):
    """The local backend's cluster with every process started by an actor on its planned node."""

    def __init__(self, spec: LaunchSpec, out_dir: Path, plan: list[Assignment], live: bool = True, log=print,
                 start_timeout_s: float = 300.0, ready_timeout_s: float = 60.0) -> None:
        super().__init__(spec, out_dir, live=live, start_timeout_s=start_timeout_s)
        self.plan, self.log, self.ready_timeout_s = plan, log, ready_timeout_s
        self.hosts: dict[str, object] = {}
        self.placement = placement_rows(plan)
        self._procs_lock = threading.Lock()
        self._stop_pump = threading.Event()
        self._pump: threading.Thread | None = None

    def _create_hosts(self) -> None:
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        actor = ray.remote(ProcessHost)
        for a in self.plan:
            self.hosts[a.name] = actor.options(
                num_cpus=a.placement.num_cpus, num_gpus=a.placement.num_gpus, resources=dict(a.placement.resources),
                scheduling_strategy=NodeAffinitySchedulingStrategy(a.node.node_id, soft=False), max_concurrency=1, max_restarts=0,
            ).remote(a.name)
        pending = {a.name: (a, self.hosts[a.name].where.remote()) for a in self.plan}
        deadline = time.monotonic() + self.ready_timeout_s
        for name, (a, ref) in pending.items():
            try:
                where = ray.get(ref, timeout=max(0.1, deadline - time.monotonic()))
            except ray.exceptions.GetTimeoutError:
                raise LaunchError(f"Ray did not start {name!r} on {a.node.label()} within {self.ready_timeout_s:g} s: it asks for "
                                  f"{a.placement.describe()}, which that node has but is using for other work (see `ray status`)") from None
            except ray.exceptions.RayError as exc:
                raise LaunchError(f"could not start {name!r} on {a.node.label()}: {exc}\nEvery node needs goodspeed installed in the "
                                  "Python environment that ran `ray start` (pip install 'goodspeed[cluster]').") from None
            self.placement[name]["hostname"] = where["hostname"]

    def _prepare_models(self) -> None:
        """Build embedded (``demo:`` and ``real:``) models where they are needed: once per machine
        (processes on one machine share its model cache), all machines in parallel."""
        import ray

        from goodspeed.lm.decoding.draft_source import DraftSpec
        from goodspeed.lm.models.loading import embedded_families

        def loaded(source: str | None) -> list[str]:  # the model a draft source loads, if any
            return [DraftSpec.parse(source).model or ""] if source else []

        models = {d.name: loaded(d.draft) + [d.tokenizer or ""] for d in self.spec.expanded_drafters()}
        models["verifier"] = [self.spec.verifier.target] + loaded(self.spec.verifier.local_draft)
        machines: dict[str, tuple[Assignment, list[str]]] = {}
        for a in self.plan:
            for family in embedded_families(models[a.name]):
                _, families = machines.setdefault(a.node.ip, (a, []))
                if family not in families:
                    families.append(family)
        if not machines:
            return
        self.log(f"checking the embedded models on {len(machines)} machine(s) (built there on first use: demo ~3 min, "
                 "a real model ~10 min)")
        batch = list(machines.values())
        calls = [self.hosts[a.name].prepare_models.remote(families) for a, families in batch]
        for (a, families), (rc, tail) in zip(batch, ray.get(calls)):
            if rc != 0:
                raise LaunchError(f"preparing {', '.join(families)} on {a.node.label()} (for {a.name!r}) failed:\n{tail}")

    def _pump_loop(self) -> None:
        while not self._stop_pump.wait(PULL_S):
            with self._procs_lock:
                procs = ([self.verifier] if self.verifier is not None else []) + list(self.drafters.values())
            for proc in procs:
                try:
                    proc.pull()
                except Exception as exc:  # a slow pull is retried next time; never kill the pump
                    print(f"goodspeed launch: pulling {proc.name}'s log failed ({exc}); retrying", file=sys.stderr)

    def start_verifier(self) -> str:
        import ray

        self.out_dir.mkdir(parents=True, exist_ok=True)
        self._create_hosts()
        self._prepare_models()
        host = self.hosts["verifier"]
        verifier = self.spec.verifier
        ray.get(host.start_verifier.remote(verifier, self._made_files(verifier, VERIFIER_FILES)), timeout=60)
        with self._procs_lock:
            self.verifier = RemoteProcess(host, "verifier", self.out_dir / "verifier.log", on_line=lambda line: apply_line(self.view, line))
        self._pump = threading.Thread(target=self._pump_loop, name="goodspeed-ray-pump", daemon=True)
        self._pump.start()
        port = self.wait_serving(f" on {self.placement['verifier']['node']}")
        return f"{self.placement['verifier']['ip']}:{port}"

    def _made_files(self, spec, fields: tuple[str, ...]) -> dict[str, str]:
        """The credential files this launch made (under OUT/auth) that ``spec`` names: their
        contents travel to the process's node. Paths a spec gives itself must be valid there."""
        auth_dir = (self.out_dir / "auth").resolve()
        out = {}
        for name in fields:
            value = getattr(spec, name)
            if value is not None and Path(value).resolve().parent == auth_dir:
                out[name] = Path(value).read_text(encoding="utf-8")
        return out

    def start_drafters(self, address: str) -> None:
        import ray

        for d in self.spec.expanded_drafters():
            prompts = _prompt_file(d, self.out_dir).read_text(encoding="utf-8")
            ray.get(self.hosts[d.name].start_drafter.remote(d, address, prompts, self._made_files(d, DRAFTER_FILES)), timeout=60)
            with self._procs_lock:
                self.drafters[d.name] = RemoteProcess(self.hosts[d.name], d.name, self.out_dir / f"{d.name}.log", self.out_dir / f"{d.name}.jsonl")

    def stop(self) -> None:
        import ray

        def each(names, call, timeout_s):
            refs = {n: call(self.hosts[n]) for n in names if n in self.hosts}
            for name, ref in refs.items():
                try:
                    ray.get(ref, timeout=timeout_s)
                except ray.exceptions.RayError:
                    pass  # the actor is gone or stuck: ray.kill below ends it and its child

        try:
            drafters = [n for n, p in self.drafters.items() if p.poll() is None]
            each(drafters, lambda h: h.signal.remote(signal.SIGTERM), 30)
            each(drafters, lambda h: h.wait.remote(10), 30)
            if self.verifier is not None and self.verifier.poll() is None:
                each(["verifier"], lambda h: h.signal.remote(signal.SIGTERM), 30)
                each(["verifier"], lambda h: h.wait.remote(45), 60)
        finally:
            self._stop_pump.set()
            if self._pump is not None:
                self._pump.join(timeout=60)
            for proc in ([self.verifier] if self.verifier is not None else []) + list(self.drafters.values()):
                try:
                    proc.pull()
                except Exception:
                    pass
            each(list(self.hosts), lambda h: h.cleanup.remote(), 15)
            for host in self.hosts.values():
                ray.kill(host)
            self.hosts.clear()


def _import_ray():
    try:
        import ray
    except ImportError:
        raise LaunchError("the Ray backend needs Ray: pip install 'goodspeed[cluster]'") from None
    return ray


def connect(address: str | None) -> None:
    """Join an existing Ray cluster as a driver; a clear error (not a long retry loop) when none is there."""
    ray = _import_ray()
    address = address or os.environ.get("RAY_ADDRESS") or "auto"
    if address != "auto" and "://" not in address:
        host, _, port = address.rpartition(":")
        try:
            socket.create_connection((host or "127.0.0.1", int(port)), timeout=5).close()
        except (OSError, ValueError) as exc:
            raise LaunchError(f"no Ray cluster at {address} ({exc}); start its head with `ray start --head` "
                              "(docs/GUIDE.md: Multi-node with Ray)") from None
    try:
        ray.init(address=address, log_to_driver=False, logging_level=logging.WARNING, namespace="goodspeed")
    except (ConnectionError, RuntimeError) as exc:
        raise LaunchError(f"cannot join the Ray cluster at {address}: {exc}") from None


def cluster_nodes() -> list[NodeInfo]:
    import ray

    nodes = [NodeInfo(n["NodeID"], n.get("NodeName") or n["NodeManagerAddress"], n["NodeManagerAddress"], dict(n["Resources"]),
                      "node:__internal_head__" in n["Resources"]) for n in ray.nodes() if n["Alive"]]
    return sorted(nodes, key=lambda n: (not n.head, n.name, n.node_id))


def check_ray_spec(spec: LaunchSpec) -> None:
    linked = [d.name for d in spec.drafters if d.link is not None]
    if linked:
        raise PlacementError(f"drafters {linked} have an emulated link: links emulate edge networks on one machine (the local "
                             "backend); on a Ray cluster the drafters' links are the real network")


def launch_ray(spec: LaunchSpec, out_dir: Path, address: str | None = None, log=print, live: bool = True,
               max_rounds: int | None = None, dry_run: bool = False, ready_timeout_s: float = 60.0) -> dict:
    """Plan the placement on the cluster at ``address``, then (unless ``dry_run``) run it like
    :func:`goodspeed.launch.cluster.local.launch_local`; returns the summary (with ``placement``)."""
    check_ray_spec(spec)
    ray = _import_ray()
    connect(address)
    try:
        nodes = cluster_nodes()
        plan = plan_placement(spec, nodes)
        log(f"placement on a Ray cluster of {len(nodes)} node(s):")
        for line in format_plan(plan):
            log(line)
        if dry_run:
            return {"placement": placement_rows(plan)}
        if spec.verifier.insecure:
            log("goodspeed launch: warning: [verifier] insecure = true: traffic between the Ray nodes is plaintext")
        spec = with_run_credentials(spec, out_dir)  # a CA, certificates and tokens made here, shipped to each node
        cluster = RayCluster(spec, out_dir, plan, live=live, log=log, ready_timeout_s=ready_timeout_s)
        return run_cluster(cluster, log, max_rounds)
    finally:
        ray.shutdown()
