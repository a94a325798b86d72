"""``goodspeed launch --backend ray``: placement planning (pure), and real launches on a Ray cluster
of two logical nodes with different custom resources, started by the tests on this machine."""

import importlib.util
import json
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from goodspeed.launch.cluster.ray_cluster import NodeInfo, PlacementError, check_ray_spec, plan_placement
from goodspeed.launch.spec import SpecError
from goodspeed.launch.spec_files import load_spec
from modelkit import greedy_reference, perturbed, save_models, tiny_llama

VOCAB = 300
PROMPTS = [[5, 6, 7], [8, 9, 10, 11], [12, 13]]
MAX_NEW = 16

HEAD = NodeInfo("aa" * 28, "verifier-box", "10.0.0.1", {"CPU": 4.0, "h100": 1.0, "memory": 1e9}, head=True)
EDGE1 = NodeInfo("bb" * 28, "edge-1", "10.0.0.2", {"CPU": 2.0, "l4": 1.0})
EDGE2 = NodeInfo("cc" * 28, "edge-2", "10.0.0.3", {"CPU": 2.0, "l4": 1.0})


def spec_of(verifier=None, drafters=({"name": "a"},)):
    base = {"draft": "demo:draft-small", "prompts": "code"}
    return load_spec("spec.toml", data={"verifier": verifier or {}, "drafters": [{**base, **d} for d in drafters]})


def where(plan):
    return {a.name: a.node.name for a in plan}


def test_plan_honours_resources_and_spreads_drafters():
    spec = spec_of({"resources": {"h100": 1}}, [{"name": "a", "resources": {"l4": 1}}, {"name": "b", "resources": {"l4": 1}},
                                                 {"name": "c", "num_cpus": 0.5}])
    plan = plan_placement(spec, [HEAD, EDGE1, EDGE2])
    assert where(plan) == {"verifier": "verifier-box", "a": "edge-1", "b": "edge-2", "c": "edge-1"}
    assert plan[0].placement.demand() == {"CPU": 1.0, "h100": 1.0}


def test_plan_by_node_name_ip_or_id():
    spec = spec_of(drafters=[{"name": "a", "node": "edge-2"}, {"name": "b", "node": "10.0.0.2"}, {"name": "c", "node": "cccccc"}])
    assert where(plan_placement(spec, [HEAD, EDGE1, EDGE2])) == {"verifier": "verifier-box", "a": "edge-2", "b": "edge-1", "c": "edge-2"}


def test_absent_resource_is_a_clear_error():
    spec = spec_of(drafters=[{"name": "a"}, {"name": "tpu-box", "resources": {"tpu": 1}}])
    with pytest.raises(PlacementError) as err:
        plan_placement(spec, [HEAD, EDGE1])
    message = str(err.value)
    assert "drafter 'tpu-box'" in message and "no node offers tpu 1" in message and "edge-1 (10.0.0.2" in message and "l4 1" in message
    with pytest.raises(PlacementError, match="node 'edge-9', which is no alive node"):
        plan_placement(spec_of(drafters=[{"name": "a", "node": "edge-9"}]), [HEAD, EDGE1])
    with pytest.raises(PlacementError, match="node 'edge-1' does not offer h100 1"):
        plan_placement(spec_of(drafters=[{"name": "a", "node": "edge-1", "resources": {"h100": 1}}]), [HEAD, EDGE1])
    with pytest.raises(PlacementError, match="no alive nodes"):
        plan_placement(spec_of(), [])


def test_capacity_used_by_the_launch_itself():
    spec = spec_of(drafters=[{"name": "a", "resources": {"l4": 1}}, {"name": "b", "resources": {"l4": 1}}])
    with pytest.raises(PlacementError, match=r"drafter 'b' .* already used by this launch \(edge-1 \(10.0.0.2, bbbbbbbb\) runs a\)"):
        plan_placement(spec, [HEAD, EDGE1])
    # count = 3 copies of 1.5 CPUs: one fits the edge node (2 CPUs), two the head (4, 1 taken by the verifier); a 4th fits nowhere
    plan = plan_placement(spec_of(drafters=[{"name": "x", "count": 3, "num_cpus": 1.5}]), [HEAD, EDGE1])
    assert where(plan) == {"verifier": "verifier-box", "x-0": "edge-1", "x-1": "verifier-box", "x-2": "verifier-box"}
    with pytest.raises(PlacementError, match="drafter 'x-3' asks for CPU 1.5: every node"):
        plan_placement(spec_of(drafters=[{"name": "x", "count": 4, "num_cpus": 1.5}]), [HEAD, EDGE1])


def test_gpu_device_needs_a_gpu_reservation_and_links_are_local_only():
    with pytest.raises(PlacementError, match="device 'cuda' needs num_gpus >= 1"):
        plan_placement(spec_of({"device": "cuda"}), [HEAD])
    with pytest.raises(PlacementError, match="emulate edge networks on one machine"):
        check_ray_spec(spec_of(drafters=[{"name": "a", "link": {"rtt_ms": 40}}]))


def test_placement_keys_are_validated():
    for bad, match in (({"resources": {"CPU": 2}}, "use num_cpus"), ({"resources": {"l4": 0}}, "positive amounts"),
                       ({"resources": "l4"}, "positive amounts"), ({"num_gpus": -1}, "num_gpus must be"), ({"node": ""}, "node must be")):
        with pytest.raises(SpecError, match=match):
            spec_of(drafters=[{"name": "a", **bad}])
    with pytest.raises(SpecError, match="'verifier' is the verifier's name"):
        spec_of(drafters=[{"name": "verifier"}])


# --- a real Ray cluster ----------------------------------------------------------------------------

requires_ray = pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="the Ray backend's tests need the cluster extra")


CLUSTER_PROC = Path(__file__).with_name("ray_cluster_proc.py")


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory):
    """Two logical nodes on this machine: a 'verifier box' with h100, an 'edge device' with l4.

    Started by a process of its own (``ray_cluster_proc.py`` says why), which keeps them up until
    its stdin closes."""
    log = tmp_path_factory.mktemp("ray") / "cluster.log"
    with log.open("w") as err:
        proc = subprocess.Popen([sys.executable, str(CLUSTER_PROC)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True)
    ready, _, _ = select.select([proc.stdout], [], [], 300)  # three tries of two nodes, 30 s each at most
    line = proc.stdout.readline() if ready else ""
    if not line:
        proc.kill()
        proc.wait()
        pytest.fail(f"the Ray cluster did not start (exit code {proc.returncode}):\n{log.read_text()[-4000:]}")
    yield json.loads(line)["address"]
    proc.stdin.close()
    try:
        proc.wait(120)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    target = tiny_llama(0, vocab=VOCAB)
    root = tmp_path_factory.mktemp("models")
    paths = save_models(root, {"target": target, "draft": perturbed(target, 0.1, 1), "weak": perturbed(target, 0.6, 2)}, VOCAB)
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": str(i), "prompt_ids": p}) + "\n" for i, p in enumerate(PROMPTS)))
    target32 = tiny_llama(0, vocab=VOCAB, dtype=torch.float32)
    return paths, prompts, [greedy_reference(target32, p, MAX_NEW) for p in PROMPTS]


def _toml_value(value):
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{k} = {_toml_value(v)}" for k, v in value.items()) + " }"
    return json.dumps(value)


def write_spec(path, verifier, drafters):
    lines = ["[verifier]"] + [f"{k} = {_toml_value(v)}" for k, v in verifier.items()]
    for d in drafters:
        lines += ["", "[[drafters]]"] + [f"{k} = {_toml_value(v)}" for k, v in d.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


def tiny_spec(tmp_path, models, **drafter_b):
    paths, prompts, _ = models
    common = {"prompts": str(prompts), "max_new_tokens": MAX_NEW}
    # float32, as the reference (auto is bf16 on a CPU with native bf16)
    return write_spec(tmp_path / "spec.toml", {"target": str(paths["target"]), "budget": 8, "round_deadline_ms": 1000, "resources": {"h100": 1},
                                               "dtype": "float32"},
                      [{"name": "good", "draft": str(paths["draft"]), "resources": {"l4": 1}, **common},
                       {"name": "weak", "draft": str(paths["weak"]), "node": "edge-1", **common, **drafter_b}])


def launch(*args, timeout_s=240):
    return subprocess.run([sys.executable, "-m", "goodspeed.launch.cli", "launch", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout_s)


def results(run_dir, name):
    return [json.loads(line)["token_ids"] for line in (run_dir / f"{name}.jsonl").read_text().splitlines()]


def cluster_is_idle(address):
    """Every resource the launch reserved is free again (no actor of it is left)."""
    code = (f"import ray, json; ray.init(address={address!r}, log_to_driver=False, logging_level='ERROR'); "
            "print(json.dumps([ray.available_resources(), ray.cluster_resources()]))")
    for _ in range(40):  # Ray releases a killed actor's resources asynchronously
        available, total = json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60).stdout)
        if all(available.get(k) == total[k] for k in ("CPU", "h100", "l4")):
            return True
        time.sleep(0.5)
    return False


@pytest.mark.slow  # a Ray cluster and a whole launch (about 65 s); the default suite checks the Ray
# launcher's refusals and its Ctrl-C teardown, and the local backend's launches
@requires_ray
def test_ray_launch_serves_the_targets_output_and_honours_placement(ray_cluster, models, tmp_path):
    """Through Ray every drafter's output is the target's own greedy decoding (as through the local
    backend, whose launches the other launch tests run)."""
    spec = tiny_spec(tmp_path, models)
    dry = launch(spec, "--backend", "ray", "--address", ray_cluster, "--dry-run", "--out", tmp_path / "dry")
    assert dry.returncode == 0, dry.stderr
    assert "verifier         CPU 1, h100 1" in dry.stdout and "good             CPU 1, l4 1" in dry.stdout and not (tmp_path / "dry").exists()

    ran = launch(spec, "--backend", "ray", "--address", ray_cluster, "--out", tmp_path / "ray", "--no-live")
    assert ran.returncode == 0, ran.stdout + ran.stderr
    _, _, reference = models
    for name in ("good", "weak"):
        assert results(tmp_path / "ray", name) == reference, name
        assert (tmp_path / "ray" / f"{name}.log").stat().st_size > 0  # the drafter's log came back too
    summary = json.loads((tmp_path / "ray" / "summary.json").read_text())
    placement = {name: row["node"] for name, row in summary["placement"].items()}
    assert placement == {"verifier": "verifier-box", "good": "edge-1", "weak": "edge-1"}
    assert summary["rounds"] > 0 and all(r["exit_code"] == 0 and r["requests"] == len(PROMPTS) for r in summary["drafters"].values())
    serving = [json.loads(line) for line in (tmp_path / "ray" / "verifier.log").read_text().splitlines() if '"event": "serving"' in line]
    assert serving and serving[0]["tls"] == "mutual" and serving[0]["auth"] == "tokens"  # secure by default on Ray too
    assert cluster_is_idle(ray_cluster)


@requires_ray
def test_absent_resource_fails_fast_and_starts_nothing(ray_cluster, models, tmp_path):
    start = time.monotonic()
    ran = launch(tiny_spec(tmp_path, models, resources={"tpu": 1}), "--backend", "ray", "--address", ray_cluster, "--out", tmp_path / "run")
    assert ran.returncode == 2 and time.monotonic() - start < 60
    assert "drafter 'weak' asks for CPU 1, tpu 1, node edge-1, but node 'edge-1' does not offer tpu 1" in ran.stderr
    assert "Traceback" not in ran.stderr and not (tmp_path / "run").exists()


@requires_ray
def test_no_cluster_at_the_address_is_a_clear_error(models, tmp_path):
    ran = launch(tiny_spec(tmp_path, models), "--backend", "ray", "--address", "127.0.0.1:9", "--dry-run", timeout_s=60)
    assert ran.returncode == 2 and "no Ray cluster at 127.0.0.1:9" in ran.stderr and "ray start --head" in ran.stderr


@requires_ray
def test_ctrl_c_tears_the_cluster_down(ray_cluster, models, tmp_path):
    paths, prompts, _ = models
    long_prompts = tmp_path / "long.jsonl"
    long_prompts.write_text("".join(json.dumps({"id": str(i), "prompt_ids": [5 + i % 50, 6]}) + "\n" for i in range(2000)))
    import socket

    with socket.socket() as probe:  # a fixed verifier port (as a firewalled cluster would open)
        probe.bind(("", 0))
        port = probe.getsockname()[1]
    spec = write_spec(tmp_path / "spec.toml", {"target": str(paths["target"]), "budget": 8, "resources": {"h100": 1}, "port": port},
                      [{"name": "endless", "draft": str(paths["draft"]), "prompts": str(long_prompts), "max_new_tokens": 64, "resources": {"l4": 1}}])
    # Ctrl-C as a terminal delivers it, even under a runner started in the background: a shell's `&`
    # ignores SIGINT and an ignored signal stays ignored across exec, so a small Python resets it and
    # execs the launcher. Not a preexec_fn: this process holds gRPC threads, and running Python
    # in a forked child before its exec can abort the child (seen once in CI: SIGABRT, "epoll_wait
    # error: Bad file descriptor"); without one the child is spawned and execs at once.
    reset = "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); os.execv(sys.executable, [sys.executable] + sys.argv[1:])"
    proc = subprocess.Popen([sys.executable, "-c", reset, "-m", "goodspeed.launch.cli", "launch", str(spec), "--backend", "ray",
                             "--address", ray_cluster, "--out", str(tmp_path / "run"), "--no-live"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    results_file = tmp_path / "run" / "endless.jsonl"
    deadline = time.monotonic() + 180
    while not (results_file.exists() and results_file.read_text().count("\n") >= 3):  # results are flowing back
        if proc.poll() is not None or time.monotonic() > deadline:  # fail now: the launch would run 2,000 prompts
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)  # the launcher stops the cluster's processes
                try:
                    proc.wait(60)
                except subprocess.TimeoutExpired:
                    proc.kill()
            out, err = proc.communicate(timeout=30)
            raise AssertionError(f"no results within 180 s (exit code {proc.returncode}):\n{out}{err}")
        time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert "interrupted: stopping the cluster" in out, out + err
    assert f":{port}; starting 1 drafters" in out, out
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert 3 <= summary["drafters"]["endless"]["requests"] < 2000
    assert cluster_is_idle(ray_cluster)
    leftover = subprocess.run(["pgrep", "-f", str(paths["draft"])], capture_output=True, text=True).stdout
    assert not leftover, leftover  # no verifier or drafter process of this run is still alive


@requires_ray
@pytest.mark.slow
def test_default_demo_on_ray_gives_the_local_backends_greedy_outputs(ray_cluster, tmp_path):
    """The embedded default spec, with placement keys added (verifier on h100, drafters on l4):
    builds the demo models if missing (~3 min), then runs both backends (~1 min each)."""
    from goodspeed.launch.spec import DEFAULT_SPEC
    from goodspeed.launch.spec_files import tomllib

    data = tomllib.loads(DEFAULT_SPEC.read_text())
    data["verifier"]["resources"] = {"h100": 1}
    for d in data["drafters"]:
        d.update(resources={"l4": 1}, max_prompts=4)
    spec = write_spec(tmp_path / "default-on-ray.toml", data["verifier"], data["drafters"])
    assert launch(spec, "--out", tmp_path / "local", "--no-live", timeout_s=900).returncode == 0
    ran = launch(spec, "--backend", "ray", "--address", ray_cluster, "--out", tmp_path / "ray", "--no-live", timeout_s=900)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    greedy = [d["name"] for d in data["drafters"] if d.get("temperature", 0.0) == 0.0]
    assert len(greedy) == 3
    for name in greedy:
        assert results(tmp_path / "ray", name) == results(tmp_path / "local", name), name
    placement = json.loads((tmp_path / "ray" / "summary.json").read_text())["placement"]
    assert {row["node"] for name, row in placement.items() if name != "verifier"} == {"edge-1"} and placement["verifier"]["node"] == "verifier-box"


@requires_ray
@pytest.mark.slow
@pytest.mark.real
@pytest.mark.skipif(not __import__("goodspeed.lm.models.real", fromlist=["is_built"]).is_built("smollm2-135m-draft"),
                    reason="real:smollm2-135m is not built: run `goodspeed models get smollm2-135m` (or `make test-real`)")
def test_real_pair_on_ray_gives_the_local_backends_greedy_outputs(ray_cluster, tmp_path):
    """The shipped real-model spec on both backends: the nodes check the real models (`models get`),
    and the greedy drafter's outputs agree token for token."""
    from goodspeed.launch.spec import SPECS_DIR
    from goodspeed.launch.spec_files import tomllib

    data = tomllib.loads((SPECS_DIR / "real-smollm2.toml").read_text())
    data["verifier"].update(resources={"h100": 1})
    data["verifier"].pop("cpus")
    for d in data["drafters"]:
        d.pop("cpus")
        d.update(resources={"l4": 1}, max_prompts=2, max_new_tokens=24)
    spec = write_spec(tmp_path / "real-on-ray.toml", data["verifier"], data["drafters"])
    assert launch(spec, "--out", tmp_path / "local", "--no-live", timeout_s=900).returncode == 0
    ran = launch(spec, "--backend", "ray", "--address", ray_cluster, "--out", tmp_path / "ray", "--no-live", timeout_s=900)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert results(tmp_path / "ray", "chat") == results(tmp_path / "local", "chat")
    assert len(results(tmp_path / "ray", "chat")) == 2
