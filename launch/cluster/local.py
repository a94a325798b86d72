"""``goodspeed launch``: a verifier and N drafters as local processes, from a spec.

The verifier binds port 0 and reports the port in its ``serving`` log event; drafters start once
it is serving. The verifier's JSON round log (its stderr, copied to ``OUT/verifier.log``) feeds a
live table per drafter (alpha_hat, X, S_i, tokens/s). When every drafter has exited, or on Ctrl-C,
the drafters are stopped, the verifier gets SIGTERM (it drains), and a summary is printed and
written to ``OUT/summary.json``. Each process reads its settings from a spec file the launcher
writes (``OUT/verifier.toml``, ``OUT/<name>.toml``); each drafter writes its results to
``OUT/<name>.jsonl`` and its log to ``OUT/<name>.log``.
"""

from __future__ import annotations

import bisect
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from goodspeed.launch.cluster.certs import init_certs
from goodspeed.launch.cluster.links import EdgeNetwork, check_support
from goodspeed.launch.spec import DrafterSpec, LaunchSpec, VerifierSpec
from goodspeed.verifier.auth import add_token, write_private
from goodspeed.verifier.records import RecordError, RoundRecord

CLI = [sys.executable, "-m", "goodspeed.launch.cli"]


class LaunchError(RuntimeError):
    """A process of the cluster failed to start or died; the message carries its log tail."""


@dataclass
class DrafterView:
    alpha_hat: float = float("nan")
    goodput: float = float("nan")
    next_len: int = 0
    tokens: int = 0
    rounds: int = 0
    first_s: float | None = None
    last_s: float | None = None
    receive_s: list[float] = field(default_factory=list)  # per round: round open -> draft arrived

    def tok_s(self) -> float:
        span = (self.last_s or 0) - (self.first_s or 0)
        return self.tokens / span if span > 0 else 0.0


@dataclass
class ClusterView:
    """What the verifier's log says so far."""

    port: int | None = None
    rounds: int = 0
    first_round: dict[str, int] = field(default_factory=dict)  # drafter name -> count of rounds when first seen
    took_part: dict[str, list[int]] = field(default_factory=dict)  # drafter name -> the round counts it took part in
    drops: list[dict] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)  # round events this reader could not read (first 10)
    drafters: dict[str, DrafterView] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def apply(self, event: dict) -> None:
        with self.lock:
            if event["event"] == "serving":
                self.port = event["port"]
            elif event["event"] == "drop":
                self.drops.append(event)
            elif event["event"] == "round":
                record = RoundRecord.from_event(event)
                self.rounds += 1
                for row in record.drafters:
                    self.first_round.setdefault(row.name, self.rounds)
                    self.took_part.setdefault(row.name, []).append(self.rounds)
                    view = self.drafters.setdefault(row.name, DrafterView())
                    view.alpha_hat, view.goodput, view.next_len = row.acceptance, row.goodput, row.next_draft_length
                    view.tokens += row.gained
                    if row.receive_s is not None:
                        view.receive_s.append(row.receive_s)
                    view.rounds += 1
                    view.first_s = view.first_s or record.ts
                    view.last_s = record.ts


def daemon_spec(v: VerifierSpec) -> VerifierSpec:
    """What the launched verifier serves on: the spec's settings, on a free port unless the spec
    names one (the launcher reads the bound port back from the log)."""
    return replace(v, port=v.port or 0)


def verifier_command(v: VerifierSpec, workdir: Path) -> list[str]:
    """The verifier process's argv: ``goodspeed verifier --spec FILE``, FILE the spec's settings
    (:meth:`VerifierSpec.to_toml`) written into ``workdir`` as ``verifier.toml``, so the process
    reads every setting from the one declaration, not from an argv rebuilt flag by flag."""
    path = Path(workdir) / "verifier.toml"
    path.write_text(daemon_spec(v).to_toml(), encoding="utf-8")
    return CLI + ["verifier", "--spec", str(path)]


def node_spec(d: DrafterSpec, prompts: Path) -> DrafterSpec:
    """What a launched drafter runs on: its spec's node settings, on the prompt file the launcher
    prepared (``max_prompts`` applied)."""
    return replace(d, prompts=str(prompts), max_prompts=None)


def drafter_argv(spec_file: Path | str, address: str, out: Path | str) -> list[str]:
    return CLI + ["drafter", "--spec", str(spec_file), "--verifier", address, "--out", str(out), "--quiet"]


def drafter_command(d: DrafterSpec, address: str, prompts: Path, out: Path, workdir: Path) -> list[str]:
    """A drafter process's argv: ``goodspeed drafter --spec FILE``, FILE its node settings
    (:meth:`DrafterSpec.to_toml`) written into ``workdir`` as ``<name>.toml``; only what the
    launcher learns at run time (the verifier's address) and where results go are flags."""
    path = Path(workdir) / f"{d.name}.toml"
    path.write_text(node_spec(d, prompts).to_toml(), encoding="utf-8")
    return drafter_argv(path, address, out)


# Run by a pinned child before it execs its command: set the CPU affinity and the parent-death
# signal (both survive exec), then exec. Done in a fresh interpreter rather than a Popen
# preexec_fn: a launcher that holds gRPC threads (a Ray actor does) must not run Python in a
# forked child before its exec (gRPC skips its fork handlers then, and the child can abort).
_PIN_AND_EXEC = """import ctypes, json, os, signal, sys
cpus, die_with_parent = json.loads(sys.argv[1])
if die_with_parent and sys.platform.startswith("linux"):
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
if cpus:
    os.sched_setaffinity(0, cpus)
os.execvp(sys.argv[2], sys.argv[2:])
"""


def _pinned(cmd: list[str], cpus: tuple[int, ...] | None, threads: int | None = None,
            die_with_parent: bool = False) -> tuple[list[str], dict]:
    """``(argv, Popen keywords)`` that run ``cmd`` pinned to ``cpus`` with matching thread pools
    (Linux).

    ``threads`` sizes the thread pools when there is no pinning; ``die_with_parent`` has the
    kernel SIGTERM the child when the process that started it dies (Linux), so a child of a Ray
    actor cannot outlive the actor. Either runs ``cmd`` behind a short Python that sets them up
    and execs it (same process, same pid).
    """
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if cpus and not hasattr(os, "sched_setaffinity"):
        raise LaunchError("cpus (CPU affinity) needs Linux")
    threads = len(cpus) if cpus else threads
    if threads:
        env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    if not cpus and not die_with_parent:
        return list(cmd), {"env": env}
    setup = json.dumps([list(cpus) if cpus else None, die_with_parent])
    return [sys.executable, "-c", _PIN_AND_EXEC, setup, *cmd], {"env": env}


def _prompt_file(d: DrafterSpec, out_dir: Path) -> Path:
    source = d.prompt_path()
    if d.max_prompts is None:
        return source
    lines = [line for line in source.read_text(encoding="utf-8").splitlines() if line.strip()][: d.max_prompts]
    path = out_dir / f"{d.name}.prompts.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def apply_line(view: ClusterView, line: str) -> None:
    """Feed one line of the verifier's log to the view. Lines that are not JSON objects (a
    traceback, a library's warning) are ignored; a round event this reader cannot read is kept in
    ``view.errors`` (shown by the live table and the summary), not skipped silently."""
    if not line.startswith("{"):
        return
    try:
        event = json.loads(line)
    except json.JSONDecodeError:
        return
    try:
        view.apply(event)
    except RecordError as exc:
        with view.lock:
            if len(view.errors) < 10:
                view.errors.append(str(exc))


def _follow(stream, log_path: Path, view: ClusterView) -> None:
    with open(log_path, "w", encoding="utf-8") as log:
        for line in stream:
            log.write(line)
            log.flush()
            apply_line(view, line)


def _tail(path: Path, lines: int = 15) -> str:
    return "\n".join(path.read_text(encoding="utf-8", errors="replace").splitlines()[-lines:]) if path.exists() else ""


def _last_error(path: Path) -> str:
    """A failed process's own last word: its log's last line that says ``error``, else its last line."""
    lines = [line for line in _tail(path, 200).splitlines() if line.strip()]
    said = [line for line in lines if "error" in line.lower()]
    return (said or lines or [f"(no log at {path})"])[-1]


class LocalCluster:
    def __init__(self, spec: LaunchSpec, out_dir: Path, live: bool = True, start_timeout_s: float = 300.0) -> None:
        # One root seed for the whole run (fresh when the spec has none), recorded in the summary.
        self.spec, self.out_dir, self.live = spec.seeded(), out_dir, live
        self.start_timeout_s = start_timeout_s
        self.view = ClusterView()
        self.verifier: subprocess.Popen | None = None
        self.drafters: dict[str, subprocess.Popen] = {}
        self.network: EdgeNetwork | None = None
        self.placement: dict[str, dict] = {}  # process name -> where it ran (the Ray backend fills this)
        self.started_s = time.time()
        self._printed_s = 0.0

    def start_verifier(self) -> str:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        cmd, pinning = _pinned(verifier_command(self.spec.verifier, self.out_dir), self.spec.verifier.cpus)
        self.verifier = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, **pinning)
        threading.Thread(target=_follow, args=(self.verifier.stderr, self.out_dir / "verifier.log", self.view), daemon=True).start()
        return f"127.0.0.1:{self.wait_serving()}"

    def wait_serving(self, where: str = "") -> int:
        """The verifier's port once its log says it is serving; LaunchError if it exits or times out."""
        deadline = time.monotonic() + self.start_timeout_s
        while self.view.port is None:
            if self.verifier.poll() is not None or time.monotonic() > deadline:
                raise LaunchError(f"verifier did not start serving{where}:\n{_tail(self.out_dir / 'verifier.log')}")
            time.sleep(0.05)
        return self.view.port

    def start_drafters(self, address: str) -> None:
        drafters = self.spec.expanded_drafters()
        linked = {d.name: d.link for d in drafters if d.link is not None}
        if linked:  # each linked drafter dials the verifier through its namespace's delay proxy
            host, port = address.rsplit(":", 1)
            self.network = EdgeNetwork(linked, upstream=(host, int(port))).__enter__()
        for d in drafters:
            dial = self.network[d.name].verifier_address if d.name in linked else address
            cmd = drafter_command(d, dial, _prompt_file(d, self.out_dir), self.out_dir / f"{d.name}.jsonl", self.out_dir)
            if d.name in linked:
                cmd = self.network[d.name].wrap(cmd)
            with open(self.out_dir / f"{d.name}.log", "w") as err:
                cmd, pinning = _pinned(cmd, d.cpus)
                self.drafters[d.name] = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, **pinning)

    def rounds_with_everyone(self) -> int:
        """Rounds run since the first round by which every drafter had taken part (0 before). In
        async mode, where a round is one verification step and each drafter takes part at its own
        cadence: the fewest rounds any drafter has taken part in since then."""
        with self.view.lock:
            if not set(self.drafters) <= set(self.view.first_round):
                return 0
            start = max(self.view.first_round[n] for n in self.drafters)
            if self.spec.verifier.rounds == "async":
                return min(len(self.view.took_part[n]) - bisect.bisect_left(self.view.took_part[n], start) for n in self.drafters)
            return self.view.rounds - start + 1

    def wait(self, refresh_s: float = 1.0, max_rounds: int | None = None) -> None:
        """Until every drafter exits, or until ``max_rounds`` rounds have run since every drafter
        was taking part (start-up rounds, when some processes are still loading, do not count)."""
        shown = 0
        while any(p.poll() is None for p in self.drafters.values()):
            if max_rounds is not None and self.rounds_with_everyone() >= max_rounds:
                break
            if self.verifier.poll() is not None:
                raise LaunchError(f"verifier exited with {self.verifier.returncode}:\n{_tail(self.out_dir / 'verifier.log')}")
            if self.live:
                shown = self._render(shown)
            time.sleep(refresh_s)
        if self.live:
            self._render(shown)

    def _render(self, shown: int) -> int:
        """Redraw in place on a terminal; in logs (CI, pipes) print a table every 10 s."""
        now = time.time()
        tty = sys.stdout.isatty()
        if not tty and now - self._printed_s < 10:
            return shown
        self._printed_s = now
        lines = render_table(self.view, self.drafters, now - self.started_s, self.placement)
        if tty and shown:
            sys.stdout.write(f"\x1b[{shown}F\x1b[J")
        sys.stdout.write("\n".join(lines) + "\n")
        sys.stdout.flush()
        return len(lines)

    def stop(self) -> None:
        for proc in self.drafters.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self.drafters.values():
            _wait_or_kill(proc, 10)
        if self.verifier is not None and self.verifier.poll() is None:
            self.verifier.send_signal(signal.SIGTERM)
            _wait_or_kill(self.verifier, 45)
        if self.network is not None:
            self.network.close()
            self.network = None


def _wait_or_kill(proc: subprocess.Popen, timeout_s: float) -> None:
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)


def render_table(view: ClusterView, procs: dict[str, subprocess.Popen], elapsed_s: float, placement: dict | None = None) -> list[str]:
    """The live table; with a ``placement`` (Ray backend) each drafter's node too."""
    node = (lambda name: f" {placement.get(name, {}).get('node', '?')}") if placement else (lambda name: "")
    lines = [f"goodspeed launch: {elapsed_s:6.1f} s, {view.rounds} rounds",
             f"  {'drafter':<16} {'state':<8} {'alpha_hat':>9} {'X':>6} {'S_i':>4} {'tokens':>7} {'tok/s':>7}" + (" node" if placement else "")]
    with view.lock:
        for name, proc in procs.items():
            v = view.drafters.get(name, DrafterView())
            state = "running" if proc.poll() is None else f"exit {proc.returncode}"
            lines.append(f"  {name:<16} {state:<8} {v.alpha_hat:>9.3f} {v.goodput:>6.2f} {v.next_len:>4} {v.tokens:>7} {v.tok_s():>7.1f}"
                         + node(name))
        if view.errors:
            lines.append(f"  log schema error (the table is incomplete): {view.errors[0]}")
    return lines


def summarise(cluster: LocalCluster) -> dict:
    rows = {}
    links = {d.name: d.link for d in cluster.spec.expanded_drafters()}
    for name, proc in cluster.drafters.items():
        path = cluster.out_dir / f"{name}.jsonl"
        records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
        drafted = sum(r["drafted_tokens"] for r in records)
        accepted = sum(r["accepted_tokens"] for r in records)
        wall = sum(r["wall_s"] for r in records)
        view = cluster.view.drafters.get(name, DrafterView())
        link = links.get(name)
        failed = proc.returncode not in (0, None)
        rows[name] = {
            "error": _last_error(cluster.out_dir / f"{name}.log") if failed else None,
            "exit_code": proc.returncode, "requests": len(records), "tokens": sum(len(r["token_ids"]) for r in records),
            "rounds": sum(r["rounds"] for r in records), "acceptance": accepted / drafted if drafted else 0.0,
            "tok_per_s": sum(len(r["token_ids"]) for r in records) / wall if wall else 0.0,
            "alpha_hat": view.alpha_hat, "X": view.goodput,
            "receive_ms_median": statistics.median(view.receive_s) * 1000 if view.receive_s else None,
            "link": None if link is None else asdict(link),
        }
    elapsed = time.time() - cluster.started_s
    return {"drafters": rows, "rounds": cluster.view.rounds, "wall_s": elapsed, "tokens": sum(r["tokens"] for r in rows.values()),
            "drops": cluster.view.drops, "log_errors": list(cluster.view.errors), "out_dir": str(cluster.out_dir),
            "placement": cluster.placement, "seed": cluster.spec.seed}


def print_summary(summary: dict, log=print) -> None:
    log(f"{'drafter':<16} {'exit':>4} {'reqs':>4} {'tokens':>6} {'rounds':>6} {'accept':>6} {'alpha_hat':>9} {'X':>6} {'tok/s':>7} {'recv ms':>7}")
    for name, r in summary["drafters"].items():
        recv = f"{r['receive_ms_median']:>7.1f}" if r.get("receive_ms_median") is not None else f"{'-':>7}"
        log(f"{name:<16} {r['exit_code']:>4} {r['requests']:>4} {r['tokens']:>6} {r['rounds']:>6} {r['acceptance']:>6.3f} "
            f"{r['alpha_hat']:>9.3f} {r['X']:>6.2f} {r['tok_per_s']:>7.1f} {recv}")
    for name, r in summary["drafters"].items():
        if r.get("error"):
            log(f"drafter {name} exited with {r['exit_code']}: {r['error']} (log: {Path(summary['out_dir']) / f'{name}.log'})")
    for error in summary.get("log_errors", []):
        log(f"unreadable round event in the verifier's log: {error}")
    log(f"{summary['tokens']} tokens in {summary['wall_s']:.1f} s ({summary['tokens'] / summary['wall_s']:.1f} tok/s overall), "
        f"{summary['rounds']} rounds; results in {summary['out_dir']}")


def local_plan(spec: LaunchSpec) -> list[str]:
    """``--dry-run`` for the local backend: every process runs here; its command line."""
    lines = ["every process runs on this machine:", "  verifier: " + " ".join(CLI + ["verifier", "--spec", "OUT/verifier.toml"]),
             *("    " + line for line in daemon_spec(spec.verifier).to_toml().splitlines())]
    for d in spec.expanded_drafters():
        dial = "VERIFIER_ADDRESS" if d.link is None else "VERIFIER_ADDRESS via its emulated link"
        prompts = d.prompt_path() if d.max_prompts is None else Path(f"OUT/{d.name}.prompts.jsonl")
        lines += [f"  {d.name}: " + " ".join(drafter_argv(f"OUT/{d.name}.toml", dial, f"OUT/{d.name}.jsonl")),
                  *("    " + line for line in node_spec(d, prompts).to_toml().splitlines())]
    return lines


def with_run_credentials(spec: LaunchSpec, out_dir: Path) -> LaunchSpec:
    """Secure by default: credentials made for this run in ``OUT/auth/`` (0700), each part only
    where the spec names none of its own.

    * Mutual TLS: a throwaway CA, a server certificate for localhost / 127.0.0.1 and one client
      certificate per ``[[drafters]]`` entry (common name: the entry's name); drafters check the
      server's certificate as ``localhost``, whatever address (an edge link's proxy) they dial.
    * Bearer tokens: one per entry (its identity is the entry's name; ``count`` copies share it),
      hashes in the verifier's token file, each token in its own 0600 file.

    ``insecure = true`` in ``[verifier]`` opts out of the TLS part (tokens are still made).
    """
    verifier, drafters = spec.verifier, list(spec.drafters)
    wants_tls = verifier.tls_cert is None and not verifier.insecure  # `insecure = true` opts out of TLS only
    if not wants_tls and verifier.auth_tokens is not None:
        return spec
    auth_dir = out_dir / "auth"
    shutil.rmtree(auth_dir, ignore_errors=True)  # a rerun into the same OUT gets fresh throwaway credentials
    auth_dir.mkdir(parents=True)
    auth_dir.chmod(0o700)
    if wants_tls:
        issued = init_certs(auth_dir, names=tuple(d.name for d in drafters))
        verifier = replace(verifier, tls_cert=str(issued["server"].cert), tls_key=str(issued["server"].key),
                           tls_client_ca=str(issued["ca"].cert))
        drafters = [d if d.tls_ca is not None else replace(d, tls_ca=str(issued["ca"].cert), tls_cert=str(issued[d.name].cert),
                                                           tls_key=str(issued[d.name].key), tls_server_name="localhost")
                    for d in drafters]
    if verifier.auth_tokens is None:
        tokens = auth_dir / "tokens.json"
        verifier = replace(verifier, auth_tokens=str(tokens))
        for i, d in enumerate(drafters):
            if d.token_file is None:
                path = auth_dir / f"{d.name}.token"
                write_private(path, add_token(tokens, d.name) + "\n")
                drafters[i] = replace(d, token_file=str(path))
    return replace(spec, verifier=verifier, drafters=tuple(drafters))


def launch_local(spec: LaunchSpec, out_dir: Path, log=print, live: bool = True, max_rounds: int | None = None) -> dict:
    """Run the cluster until its drafters finish (or ``max_rounds`` rounds); returns the summary."""
    if any(d.link is not None for d in spec.drafters):
        check_support()  # refuse before anything starts
    return run_cluster(LocalCluster(with_run_credentials(spec, out_dir), out_dir, live=live), log, max_rounds)


def run_cluster(cluster: LocalCluster, log=print, max_rounds: int | None = None) -> dict:
    """Start the verifier, then the drafters; wait; tear down (also on Ctrl-C); write the summary."""
    try:
        address = cluster.start_verifier()
        log(f"verifier serving on {address}; starting {len(cluster.spec.expanded_drafters())} drafters")
        cluster.start_drafters(address)
        cluster.wait(refresh_s=0.2 if max_rounds else 1.0, max_rounds=max_rounds)
    except KeyboardInterrupt:
        log("interrupted: stopping the cluster")
    finally:
        cluster.stop()
    summary = summarise(cluster)
    (cluster.out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    print_summary(summary, log)
    return summary
