#!/usr/bin/env bash
# One call on a lent GPU machine (see DEVELOPERS' guide): probe the machine, then the stages
# asked for. Everything lands under $OUT (logs, JUnit XML, JSON results); the end of stdout is
# a short summary.
#
#   bash benchmarks/gpu_session.sh [STAGE] [pytest args...]
#
# STAGE: tests (the suite on CUDA, pytest-xdist), throughput (benchmarks.throughput --device
# cuda), tests+throughput, attention (benchmarks.attention), bench (attention, then
# throughput), distributed (benchmarks.gpu_distributed: data-parallel replicas sharing the
# GPU), ab (llmlab alone, the engine's defaults against each switch turned off:
# --no-cuda-fused-ops, --async-scheduling off; then one sequence's decode split; about 4
# minutes), moe (issue 43: the fused MoE / W4A16 / MoE engine tests on the card, then
# benchmarks.moe --device cuda; about 4 minutes), or all (the default: tests, then benchmarks.attention; about 10 minutes, one
# call's limit). TPUT_ARGS and ATTN_ARGS add arguments to those two benchmarks (e.g.
# TPUT_ARGS="--only llmlab", ATTN_ARGS=--quick) so several stages fit one call.
#
# Missing Python packages travel as wheels in .whl/ (installed into /tmp/site), because that
# machine has no package index. Each stage has its own time limit so one stuck stage cannot
# eat the whole call.
set -u
OUT=${OUT:-/tmp/gpu_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
stage=${1:-all}
shift || true
if [ -d /tmp/site ]; then
    export PYTHONPATH=/tmp/site:$PWD    # an earlier stage of this call installed the wheels
elif [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit 1
else
    export PYTHONPATH=$PWD
fi

{
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv
    python3 -c "import torch, triton, transformers, sys; print(sys.version.split()[0], \
torch.__version__, torch.version.cuda, triton.__version__, transformers.__version__)"
    command -v g++ c++ clang++ || true
    nproc
} 2>&1 | tee "$OUT/machine.txt"

if [ "$stage" = tests ] || [ "$stage" = all ] || [ "$stage" = tests+throughput ]; then
    paths=("$@")
    [ ${#paths[@]} -eq 0 ] && paths=(tests)
    # -v: a run cut by its time limit still names every test that finished. The workers
    # share the GPU (tests/conftest.py gives each an equal slice of its memory).
    timeout -k 10 "${TEST_TIMEOUT:-420}" python3 -m pytest -v --tb=short -p no:cacheprovider \
        -n "${TEST_WORKERS:-8}" --timeout 120 --durations 25 -rfE \
        --junitxml "$OUT/junit.xml" "${paths[@]}" > "$OUT/pytest.log" 2>&1
    echo "pytest exit $?"
    grep -E "(FAILED|ERROR) tests/" "$OUT/pytest.log" | sed 's/^\[gw[0-9]*\] \[ *[0-9]*%\] //' \
        | cut -c1-200 | sort -u | head -80
    tail -3 "$OUT/pytest.log"
fi

if [ "$stage" = distributed ]; then
    timeout -k 10 "${DIST_TIMEOUT:-240}" python3 -m benchmarks.gpu_distributed \
        > "$OUT/distributed.log" 2>&1
    echo "distributed exit $?"
    tail -20 "$OUT/distributed.log"
fi

if [ "$stage" = moe ]; then
    # Issue 43's GPU checks: the fused MoE kernel, W4A16 GEMM and MoE engine tests compiled
    # on the card (they ran only in Triton's interpreter before), then their speed.
    timeout -k 10 "${TEST_TIMEOUT:-240}" python3 -m pytest -q --tb=short -p no:cacheprovider \
        -n "${TEST_WORKERS:-4}" --timeout 120 -rfE tests/models/test_fused_moe.py \
        tests/quantization/test_int4_kernels.py tests/quantization/test_w4a16.py \
        tests/quantization/test_int4.py tests/engine/test_moe.py tests/engine/test_expert_load.py \
        > "$OUT/moe_tests.log" 2>&1
    echo "moe tests exit $?"; grep -E "(FAILED|ERROR) tests/" "$OUT/moe_tests.log" | head -20
    tail -2 "$OUT/moe_tests.log"
    timeout -k 10 "${BENCH_TIMEOUT:-150}" python3 -m benchmarks.moe --device cuda \
        > "$OUT/moe_bench.log" 2>&1
    echo "benchmarks.moe exit $?"; tail -25 "$OUT/moe_bench.log"
fi

if [ "$stage" = ab ]; then
    # One machine, one process each, in turn; the summary lines of each run.
    for variant in default --no-cuda-fused-ops "--async-scheduling off"; do
        name=$(echo "$variant" | tr -c 'a-z0-9\n' '_')
        extra=$variant
        [ "$variant" = default ] && extra=
        timeout -k 10 "${TPUT_TIMEOUT:-120}" python3 -m benchmarks.throughput --device cuda \
            --only llmlab $extra --json "$OUT/ab_$name.json" > "$OUT/ab_$name.log" 2>&1
        echo "== $variant (exit $?)"
        grep -E "^wall|of the roofline \(|host \(wall|gaps >" "$OUT/ab_$name.log"
    done
    timeout -k 10 "${TPUT_TIMEOUT:-120}" python3 -m benchmarks.throughput --device cuda \
        --only llmlab --num-requests 8 --decode-batch 1 > "$OUT/ab_single.log" 2>&1
    echo "== one sequence (exit $?)"
    grep -E "host \(wall|gaps >" "$OUT/ab_single.log"
fi

if [ "$stage" = bench ] || [ "$stage" = all ] || [ "$stage" = attention ]; then
    timeout -k 10 "${ATTN_TIMEOUT:-170}" python3 -m benchmarks.attention ${ATTN_ARGS:-} \
        --json "$OUT/attention.json" > "$OUT/attention.log" 2>&1
    echo "attention exit $?"
    tail -45 "$OUT/attention.log"
fi

if [ "$stage" = throughput ] || [ "$stage" = bench ] || [ "$stage" = tests+throughput ]; then
    timeout -k 10 "${TPUT_TIMEOUT:-300}" python3 -m benchmarks.throughput --device cuda ${TPUT_ARGS:-} \
        --json "$OUT/throughput.json" > "$OUT/throughput.log" 2>&1
    echo "throughput exit $?"
    tail -60 "$OUT/throughput.log"
fi
