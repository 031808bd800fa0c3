#!/usr/bin/env bash
# The GPU comparisons of benchmarks/RESULTS.md ("One GPU"), as one command on a CUDA machine that has torch but no
# network: SFT and RM (bench_sft.py --gpu) and PPO (bench_ppo.py --gpu) on a ~1B random-init Llama in bf16
# mixed precision, rlhfkit against TRL 1.16.0 (SFT, RM) and TRL 1.12.0 (PPO).
#
#   bash benchmarks/gpu_run.sh [OUT_DIR]
#
# The Python packages the machine lacks come as wheels fetched beforehand on a machine with the package index
# (pure-Python wheels, so any x86-64 Linux works; the tokenizers and hf-xet wheels are abi3):
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 -d .whl \
#       transformers==5.24.0 huggingface_hub==2.4.0 httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5 \
#       tokenizers==0.23.3 datasets==5.2.0 dill==0.4.1 \
#       multiprocess==0.70.19 peft==0.21.2 hf-xet==1.8.0 fsspec==2026.9.0
#   pip download ... -d .whl-trl112 trl==1.12.0;   pip download ... -d .whl-trl116 trl==1.16.0
# Each step has its own time limit, so one that fails or hangs leaves the others their time; logs go to OUT_DIR.
set -u
OUT_DIR=${1:-${OUT:-/tmp/gpu-out}}
mkdir -p "$OUT_DIR"
cd "$(dirname "$0")/.."
start=$SECONDS
install() {  # install <wheel folder> <target>
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$2" "$1"/*.whl
}
install .whl /tmp/site && install .whl-trl112 /tmp/trl112 && install .whl-trl116 /tmp/trl116 || exit 1
export PYTHONPATH=$PWD/src:/tmp/site PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
for v in 112 116; do  # an interpreter that sees TRL $v ahead of the rest
    printf '#!/bin/sh\nPYTHONPATH=/tmp/trl%s:$PYTHONPATH exec python3 "$@"\n' $v > /tmp/python-trl$v
    chmod +x /tmp/python-trl$v
done
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv | tee "$OUT_DIR/gpu.txt"
python3 -c "import torch, transformers, datasets; print('torch', torch.__version__, 'transformers',
    transformers.__version__, 'datasets', datasets.__version__)" | tee -a "$OUT_DIR/gpu.txt"
/tmp/python-trl112 -c "import trl; print('trl', trl.__version__)" | tee -a "$OUT_DIR/gpu.txt"
/tmp/python-trl116 -c "import trl; print('trl', trl.__version__)" | tee -a "$OUT_DIR/gpu.txt"

step() {  # step <name> <seconds> <command...>: run it under a time limit, its output to OUT_DIR/<name>.log
    local name=$1 limit=$2
    shift 2
    echo "== $name (at ${SECONDS}s, limit ${limit}s): $*"
    timeout "$limit" "$@" > "$OUT_DIR/$name.log" 2>&1
    echo "== $name: exit $? after $((SECONDS - start))s"
    pkill -9 -f "benchmarks/bench_" 2> /dev/null  # workers a timed-out step left behind hold GPU memory
    tail -n 25 "$OUT_DIR/$name.log"
}
has_vllm() {
    python3 -c "import vllm" 2> /dev/null && return 0
    echo "== vLLM rows skipped: vllm is not importable here (pip install 'vllm>=0.33,<0.34' on this machine first)"
    return 1
}
# STEPS picks and orders them (default: all, the ones without a like-for-like number yet first). rm-padded times
# rlhfkit's RM with packing off (padded micro-batches, one attention call per layer, as TRL's) against the packed
# default, whose attention runs once per packed sequence: which of the two belongs on CUDA.
SFT_RM=(--gpu --sizes 1B --rows 64 --micro 8 --threads 4 --warmup 1 --trl-python /tmp/python-trl116)
# ppo-vllm against ppo: PPO with vLLM rollouts against PPO native, both against TRL 1.12 in the same run; grpo-vllm:
# rlhfkit GRPO with colocated vLLM against TRL 1.16's GRPOTrainer with use_vllm colocate, the same work.
for name in ${STEPS:-ppo decode ppo-vllm grpo-vllm rm rm-padded sft}; do
    case $name in
        ppo) step ppo 180 python3 benchmarks/bench_ppo.py --gpu --sizes 1B --shapes "${PPO_SHAPES:-16:128}" \
                 --threads 4 --iters 3 --warmup 1 --trl-python /tmp/python-trl112 --json "$OUT_DIR/ppo.json" ;;
        rm) step rm 120 python3 benchmarks/bench_sft.py "${SFT_RM[@]}" --stages rm --iters 3 --json "$OUT_DIR/rm.json" ;;
        rm-padded) step rm-padded 120 python3 benchmarks/bench_sft.py "${SFT_RM[@]}" --stages rm --iters 3 \
                       --rlhfkit-set packing=false --json "$OUT_DIR/rm-padded.json" ;;
        # decode: where generation's time goes (rlhfkit's loop against generate with a dynamic and a static,
        # compiled, KV cache), the 80% of the PPO row
        decode) step decode 240 python3 benchmarks/bench_decode_gpu.py --gpu --batch 16 --response 128 --iters 3 \
                    --json "$OUT_DIR/decode.json" ;;
        sft) step sft 120 python3 benchmarks/bench_sft.py "${SFT_RM[@]}" --stages sft --iters 4 --json "$OUT_DIR/sft.json" ;;
        # vLLM rows (docs/vllm.md): they need the CUDA vllm importable on the GPU machine (its wheels are too large
        # to carry: install vllm 0.33 there first); without it they say so and end
        ppo-vllm) has_vllm && step ppo-vllm 240 python3 benchmarks/bench_ppo.py --gpu --sizes 1B \
                      --shapes "${PPO_SHAPES:-16:128}" --threads 4 --iters 3 --warmup 1 --trl-python /tmp/python-trl112 \
                      --rlhfkit-set rollout.engine=vllm --rlhfkit-set rollout.memory=0.3 --json "$OUT_DIR/ppo-vllm.json" ;;
        grpo-vllm) has_vllm && step grpo-vllm 300 python3 benchmarks/bench_grpo.py --gpu --sizes 1B --vllm \
                       --prompts 16 --group 8 --response 128 --threads 4 --iters 3 --warmup 1 \
                       --trl-python /tmp/python-trl116 --json "$OUT_DIR/grpo-vllm.json" ;;
        *) echo "unknown step $name" ;;
    esac
done
echo "== done after $((SECONDS - start))s"
