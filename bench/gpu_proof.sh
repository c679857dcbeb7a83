#!/usr/bin/env bash
# The GPU proof, in one command on a CUDA machine: bash bench/gpu_proof.sh
# Runs the suite (its CUDA test included) and the slow tests, trains the gpu preset for 300 steps with learned
# and with rotary positions (compiled, bf16 autocast, fused AdamW), samples from each at every precision with
# and without the KV cache, and prints the figures. Everything goes under runs/gpu-proof/.
set -euo pipefail
cd "$(dirname "$0")/.."
python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'gpu_proof.sh: no CUDA device found')"
python -c "import torch; print('#', torch.cuda.get_device_name(), 'torch', torch.__version__)"
python -m pytest -q -rs
python -m pytest -q -m slow
for pos in learned rope; do
    python train.py preset=gpu model.pos_emb=$pos train.max_iters=300 train.eval_interval=100 \
        hydra.run.dir=runs/gpu-proof/$pos
    for precision in fp32 bf16 int8; do
        for cache in "" --no-kv-cache; do
            echo "## $pos, $precision ${cache:-with the KV cache}"
            python sample.py --checkpoint runs/gpu-proof/$pos --device cuda --precision $precision $cache \
                --seed 1 --temperature 0 --max-new-tokens 600 --prompt "ROMEO:" | tail -n 3
        done
    done
done
