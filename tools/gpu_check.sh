#!/usr/bin/env bash
# The checks a GPU machine is for, in one run (about 7 minutes on one H100/H200):
#
#   tools/gpu_check.sh [OUTDIR]          # logs and tables into OUTDIR (default: gpu-check/)
#
# 1. the CUDA cases of the device-parametrized tests (tests/test_devices.py,
#    tests/ops/test_autocast.py, tests/optim/test_fused.py), then the rest of the suite
#    (pytest-xdist) with the machine's torch;
# 2. the README's commands on the GPU: the quickstart under torchrun with 2 ranks (one GPU: the
#    launcher picks Gloo with CUDA tensors) and the demo with --device cuda for a few steps;
# 3. benchmarks/one_rank_step.py --device cuda: a one-rank training step, fshard against plain
#    torch, DTensor and FSDP2 (small Llama, with --compile).
# Each part's output goes to its own log; the summary lines are printed at the end.
set -uo pipefail
out="${1:-gpu-check}"
mkdir -p "$out"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
py="${PYTHON:-python3}"
{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    "$py" -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, "nccl", torch.cuda.nccl.version())'
} > "$out/env.txt" 2>&1
run() {  # run NAME LIMIT_SECONDS COMMAND...: one part, its log and exit status
    local name="$1" limit="$2"
    shift 2
    local t0=$SECONDS
    timeout "$limit" "$@" > "$out/$name.log" 2>&1
    echo "$name: rc=$? in $((SECONDS - t0)) s" >> "$out/summary.txt"
}
cuda="tests/test_devices.py tests/ops/test_autocast.py tests/optim/test_fused.py"
run cuda_tests 110 "$py" -m pytest -q -p no:cacheprovider -rs --timeout 100 $cuda
ignore=""
for f in $cuda; do ignore="$ignore --ignore $f"; done
run suite 200 "$py" -m pytest -q -p no:cacheprovider -n "${JOBS:-12}" --timeout 120 -rfE $ignore
run quickstart_torchrun 40 "$py" -m torch.distributed.run --nproc-per-node 2 examples/quickstart.py --device cuda
run train_gpt_cuda 40 "$py" examples/train_gpt.py --device cuda --steps 20
run bench_small 150 "$py" benchmarks/one_rank_step.py --device cuda --size small --steps 20 --compile
cat "$out/env.txt" "$out/summary.txt"
tail -n 3 "$out/suite.log"
grep -E "passed|failed|skipped" "$out/cuda_tests.log" | tail -n 2
