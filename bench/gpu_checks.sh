#!/usr/bin/env bash
# The device checks of bench/GPU.md in one script, for one `run` call of the device tool:
#
#   bash bench/gpu_checks.sh [STEP ...]     # steps: tests kernels graphs assisted (the default),
#                                           # and chunked, attention, first, fullsize, busy
#                                           # (by name only)
#
# Run from the repository root with `carry: [".whl", ".gpu"]`: the wheels of bench/gpu_wheels.txt
# that GPU.md fetches, and in .gpu/ the weightless checkpoints (config and tokenizer) the
# benchmarks make once under /tmp, made here, since the device reaches no package index. The
# `tests` step runs every CUDA-marked test of the tree. Every step has its own time limit
# (TESTS_S, KERNELS_S, GRAPHS_S, ASSISTED_S, CHUNKED_S, ATTENTION_S, FIRST_S, FULLSIZE_S, BUSY_S;
# arguments in GRAPHS_ARGS, ASSISTED_ARGS, CHUNKED_ARGS, FIRST_ARGS, FULLSIZE_ARGS; BUSY_MODEL), so one that
# hangs or fails leaves the others' results; logs and
# JSONs land in $OUT (or /tmp/gpu_checks without it). PEAK_GBPS: the card's HBM bandwidth
# (default: H100 SXM).
set -u
OUT=${OUT:-/tmp/gpu_checks}
mkdir -p "$OUT"
steps=${*:-tests kernels graphs assisted}
peak=${PEAK_GBPS:-3350}

if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
fi
[ -d .gpu ] && cp -r .gpu/. /tmp/
# The repository installs under `toppings.` through pyproject's package-dir: mirror it with links.
mkdir -p /tmp/pkg/toppings
for p in server cpu_lora gpu_lora scheduler scripts; do ln -sfn "$PWD/$p" "/tmp/pkg/toppings/$p"; done
export PYTHONPATH=/tmp/site:/tmp/pkg:$PWD PYTHONUNBUFFERED=1 OMP_WAIT_POLICY=PASSIVE
log=$OUT/steps.log
{ date -u; nvidia-smi -L; nproc; python3 -c "import torch, triton, transformers;
print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__,
      'cuda', torch.cuda.is_available(), torch.cuda.get_device_name() if torch.cuda.is_available() else '')"
} >>"$log" 2>&1
# What collecting the tests needs beyond the image, named in one line if a wheel was left behind
missing=$(python3 -c "import importlib.util as u; print(' '.join(m for m in
    'flask waitress posix_ipc gguf llguidance openai jsonschema'.split() if not u.find_spec(m)))")
[ -n "$missing" ] && echo "missing, carry their wheels (GPU.md): $missing" >>"$log"

step() {  # step NAME SECONDS COMMAND...: run one check under its limit, its tail in steps.log
    local name=$1 limit=$2
    shift 2
    echo "=== $name (limit ${limit}s) $(date -u +%T)" >>"$log"
    timeout -k 10 "$limit" "$@" >"$OUT/$name.log" 2>&1
    echo "=== $name: rc $? $(date -u +%T)" >>"$log"
    tail -n 40 "$OUT/$name.log" >>"$log"
}

# SmolLM2's shapes with random weights (graphs, busy): launch overhead shows on small layers
smol="[ -f /tmp/smol-shaped/config.json ] || python3 -m toppings.scripts.make_tiny_llama \
    /tmp/smol-shaped --layers 30 --hidden 576 --intermediate 1536 --heads 9 --kv-heads 3 \
    --vocab 49152 --max-positions 2048"

for s in $steps; do
    case $s in
    tests)
        # the whole tree's CUDA-marked tests; a file that fails to collect costs its own only
        step cuda_tests "${TESTS_S:-200}" python3 -m pytest -q -m cuda -p no:cacheprovider \
            -rA --tb=short --continue-on-collection-errors tests ;;
    kernels)
        step kernels "${KERNELS_S:-90}" python3 -m bench.bench_kernels --peak-gbps "$peak" \
            --out "$OUT/kernels.json" ;;
    graphs)
        step graphs "${GRAPHS_S:-150}" bash -c "$smol && python3 -m bench.bench_cuda_graphs \
            --model /tmp/smol-shaped ${GRAPHS_ARGS:---batch-sizes 1,8,32,64} --out $OUT/cuda_graphs_smol.json" ;;
    busy)  # the GPU's busy fraction of 64 requests decoding (../shared/gpu/gpu_busy.py, in .gpu/)
        step busy "${BUSY_S:-120}" bash -c "$smol && python3 /tmp/gpu_busy.py cuda \
            ${BUSY_MODEL:-/tmp/smol-shaped} $OUT/gpu_busy.txt 64" ;;
    assisted)
        step assisted "${ASSISTED_S:-140}" python3 -m bench.bench_cpu_assisted --device cuda \
            --cpu-workers 8 --out "$OUT/cpu_assisted_cuda.json" ${ASSISTED_ARGS:-} ;;
    attention)  # one layer's attention: the gather / SDPA path against the paged Triton kernels
        step attention "${ATTENTION_S:-60}" python3 -m bench.bench_paged_attention \
            --out "$OUT/paged_attention.json" ;;
    chunked)  # chunked prefill under load on Llama-2-7B's shapes (random weights)
        step chunked "${CHUNKED_S:-300}" python3 -m bench.bench_chunked_prefill --device cuda \
            --model /tmp/toppings-dummy-llama-2-7b-32l --load-format dummy \
            ${CHUNKED_ARGS:---quick} --out "$OUT/chunked_prefill_cuda.json" ;;
    first)  # a fresh server's first requests against warm ones (Llama-2-7B's shapes, 4 layers)
        step first "${FIRST_S:-150}" python3 -m bench.bench_first_request --device cuda \
            --model /tmp/toppings-dummy-llama-2-7b-4l --serve-args "--load-format dummy" \
            ${FIRST_ARGS:---rounds 2 --warm 3} --out "$OUT/first_request_cuda.json" ;;
    fullsize)  # Llama-3.1-8B's shapes, 16 adapters against the base, batch 1-256 (issue 63)
        step fullsize "${FULLSIZE_S:-300}" python3 -m bench.bench_full_size --device cuda \
            --peak-gbps "$peak" ${FULLSIZE_ARGS:-} --out "$OUT/full_size.json" ;;
    *) echo "unknown step $s" >>"$log" ;;
    esac
done
