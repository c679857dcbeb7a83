#!/usr/bin/env bash
# The GPU proof, in one command on a CUDA machine: bash bench/gpu_proof.sh
# Runs the suite (its CUDA tests included) and the slow tests on the CPU's cores while the GPU trains the gpu
# preset for 300 steps with learned and with rotary positions (compiled, bf16 autocast, fused AdamW), side by side.
# Then it samples greedily from each at every precision, with the KV cache, without it and compiled, and says
# whether the texts agree. Everything goes under runs/gpu-proof/; the figures are printed at the end.
set -uo pipefail
cd "$(dirname "$0")/.."
python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'gpu_proof.sh: no CUDA device found')" \
    || exit 2
out=runs/gpu-proof
mkdir -p "$out"
python -c "import torch; print('#', torch.cuda.get_device_name(), 'torch', torch.__version__)"
python -m pytest -q -rs >"$out/tests.log" 2>&1 & tests=$!
python -m pytest -q -m slow >"$out/slow-tests.log" 2>&1 & slow=$!

prove() {  # trains one model, samples from it nine ways and compares the texts; the status says whether they agree
    local pos=$1 failed=0 samples=()
    python train.py preset=gpu model.pos_emb=$pos train.max_iters=300 train.eval_interval=100 \
        hydra.run.dir=$out/$pos >"$out/$pos.log" 2>&1 || { tail -n 5 "$out/$pos.log"; return 1; }
    tr '\r' '\n' <"$out/$pos.log" | grep -v "it/s]$" | tail -n 12
    for precision in fp32 bf16 int8; do  # the samples run side by side: each is a small process on the GPU
        for cache in cached uncached compiled; do
            flag=$([ $cache = uncached ] && echo --no-kv-cache || { [ $cache = compiled ] && echo --compile; })
            python sample.py --checkpoint $out/$pos --device cuda --precision $precision $flag --seed 1 \
                --temperature 0 --max-new-tokens 600 --prompt "ROMEO:" \
                >"$out/$pos/$precision-$cache.txt" 2>"$out/$pos/$precision-$cache.log" & samples+=($!)
        done
    done
    for pid in "${samples[@]}"; do wait "$pid" || failed=1; done
    for precision in fp32 bf16 int8; do
        echo "## $pos, $precision: $(tail -n 1 "$out/$pos/$precision-cached.log")"
        for other in uncached compiled; do
            if cmp -s "$out/$pos/$precision-cached.txt" "$out/$pos/$precision-$other.txt"; then
                echo "   $other: the same text"
            else
                echo "   $other: a different text ($(tail -n 1 "$out/$pos/$precision-$other.log"))"
                [ $precision = fp32 ] && failed=1  # in fp32 the three must agree; lower precisions may drift
            fi
        done
        tail -n 3 "$out/$pos/$precision-cached.txt"; echo
    done
    return $failed
}

# The two models train side by side on the GPU, each reporting into its own file.
prove learned >"$out/learned.proof" 2>&1 & learned=$!
prove rope >"$out/rope.proof" 2>&1 & rope=$!
failed=0
wait $learned || failed=1
wait $rope || failed=1
cat "$out/learned.proof" "$out/rope.proof"
wait $tests || failed=1
wait $slow || failed=1
echo "## the suite"; tail -n 15 "$out/tests.log"
echo "## the slow tests"; tail -n 5 "$out/slow-tests.log"
exit $failed
