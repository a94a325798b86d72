#!/usr/bin/env bash
# The checks that need a GPU, in one run (a machine with CUDA torch, transformers and pytest, and
# no network): the CUDA tests (flash's varlen kernel against each row's attention in float64, packed
# forwards and whole engine rounds through it against masked SDPA; steps captured and replayed as
# CUDA graphs against the same steps run eagerly; drafting and local serving with both models on
# the device, greedy against the target's own and sampled by chi-square),
# bench.bench_varlen, bench.bench_tree_round and bench.bench_drafting.
#   bash bench/gpu_checks.sh [OUTDIR]      # results in OUTDIR (default: gpu-checks/)
#   BENCH=0 bash bench/gpu_checks.sh ...   # the tests only
#   WHEELS=DIR bash bench/gpu_checks.sh ... # first install DIR's wheels (no deps) for this run only:
#                                           # the gRPC and API tests need grpcio-health-checking, pydantic, openai...
#                                           # (bash bench/gpu_wheels.sh DIR, where PyPI is reachable, fetches them)
# The project is used from this checkout without installing it (a goodspeed.* package of links).
set -uo pipefail
out=${1:-gpu-checks}
mkdir -p "$out"
root=$(cd "$(dirname "$0")/.." && pwd)
pkg=$(mktemp -d)/goodspeed
mkdir -p "$pkg"
for d in api drafter launch lm proto scheduler serving verifier; do ln -s "$root/$d" "$pkg/$d"; done
export PYTHONPATH="$(dirname "$pkg")" PYTHONUNBUFFERED=1
if [ -n "${WHEELS:-}" ]; then
    site=$(mktemp -d)
    python3 -m pip install -q --no-deps --no-index --target "$site" "$WHEELS"/*.whl && PYTHONPATH="$PYTHONPATH:$site"
fi
cd "$root"
python3 - <<'PY' 2>&1 | tee "$out/probe.txt"
import inspect, torch, transformers
from goodspeed.lm.runtime.attention import flash_varlen_kernel
print("torch", torch.__version__, "transformers", transformers.__version__, "device", torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA")
try:
    from torch.nn.attention.varlen import varlen_attn
    print("varlen_attn", inspect.signature(varlen_attn))
except ImportError as exc:
    print("no varlen_attn:", exc)
print(torch.ops.aten._flash_attention_forward.default._schema)
kernel = flash_varlen_kernel()
print("kernel:", kernel and kernel.name)
PY
timeout 240 python3 -m pytest -q -p no:cacheprovider -rs tests/lm/runtime/test_attention.py tests/lm/runtime/test_kv_slots.py \
    tests/lm/runtime/test_graphs.py tests/verifier/test_engine_reference.py 2>&1 | tee "$out/tests.txt"
timeout 300 python3 -m pytest -q -p no:cacheprovider -rs -k cuda tests/lm/decoding/test_sampling.py tests/lm/runtime/test_batch_draft.py tests/drafter/test_runner.py \
    tests/verifier/test_local.py tests/verifier/test_local_lossless.py tests/verifier/test_server.py tests/drafter/test_node.py \
    tests/verifier/test_logprobs.py \
    2>&1 | tee "$out/tests_drafting.txt"
[ "${BENCH:-1}" = 0 ] && exit 0
for k in 1 4; do
    timeout 200 python3 -m bench.bench_varlen --repeats 30 --replicas $k --json > "$out/bench_varlen_x$k.json" 2> "$out/bench_varlen_x$k.err"
    echo "bench x$k rc=$?"; tail -5 "$out/bench_varlen_x$k.err"
done
# What a step of token trees costs against chains (KV moves, ragged rows), what folding
# grouped-query heads saves masked attention against SDPA's math kernel (path "GQA SDPA"), and
# what replaying steps as CUDA graphs saves (path "graphs"), on a random fp32 target of
# SmolLM2-135M's shape: nothing to carry.
timeout 200 python3 -m bench.bench_tree_round --device cuda --rows 16 --steps 30 --json \
    --random num_hidden_layers=30,hidden_size=576,intermediate_size=1536,num_attention_heads=9,num_key_value_heads=3,vocab_size=49152 \
    > "$out/bench_tree_round.json" 2> "$out/bench_tree_round.err"
echo "bench tree round rc=$?"; tail -2 "$out/bench_tree_round.err"
# One request's drafting on the device: the growing cache, the slot cache eager, and the slot's
# forwards replayed as CUDA graphs (goodspeed drafter --cuda-graphs), for the real draft's shape and
# an edge draft of Qwen3-0.6B's layer shapes.
for shape in num_hidden_layers=4,hidden_size=128,intermediate_size=384,num_attention_heads=2,num_key_value_heads=1,vocab_size=49152 \
             num_hidden_layers=28,hidden_size=1024,intermediate_size=3072,num_attention_heads=16,num_key_value_heads=8,vocab_size=151936; do
    layers=${shape%%,*}; layers=${layers#*=}
    timeout 150 python3 -m bench.bench_drafting --device cuda --random "$shape" --kv growing slot graphs --rounds 30 \
        > "$out/bench_drafting_${layers}layers.txt" 2>&1
    echo "bench drafting ${layers} layers rc=$?"; tail -4 "$out/bench_drafting_${layers}layers.txt"
done
python3 - "$out" <<'PY'
import json, sys
for row in json.load(open(f"{sys.argv[1]}/bench_tree_round.json"))["cells"]:
    print("  tree round", row["shape"], row["path"], row["ops"], "ops", round(row["ms"], 2), "ms")
for k in (1, 4):
    r = json.load(open(f"{sys.argv[1]}/bench_varlen_x{k}.json"))
    print(r["device"], r["kernel"], r["rows"], "rows")
    for table in ("attention", "forward"):
        for row in r[table]:
            print(" ", table, row["prefix"], row["shape"], {p: round(row[p], 3) for p in ("varlen", "kernel_only", "masked", "padded") if p in row})
PY
