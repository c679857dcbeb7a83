#!/usr/bin/env bash
# The GPU proof, in one command on a CUDA machine: bash bench/gpu_proof.sh [minutes, 8 unless given]
# 1. The cuda tests (python -m pytest -m cuda): cached steps, the compiled step, train.py and sample.py on the GPU.
# 2. The gpu preset trains 300 steps with learned and with rotary positions, side by side (compiled, bf16 autocast,
#    fused AdamW).
# 3. Each model samples greedily at every precision, with the KV cache, without it and compiled; the texts are
#    compared.
# Each stage runs within the minutes left. runs/gpu-proof/<date>_<time>/summary.txt grows as stages end.
# PYTHON names the interpreter where `python` is not the one with torch. The CPU's proofs are the suite's.
set -uo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python}
minutes=${1:-8}
refuse() { echo "gpu_proof.sh: error: $*" >&2; exit 2; }
[[ $minutes =~ ^[1-9][0-9]*$ ]] || refuse "minutes must be a whole number above 0, got '$minutes'"
"$python" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null \
    || refuse "$python finds no CUDA device (or no torch); run it on a CUDA machine, PYTHON naming the interpreter"
out=runs/gpu-proof/$(date +%Y-%m-%d_%H-%M-%S)
mkdir -p "$out" 2>/dev/null || refuse "cannot create $out; run it where runs/ can be written"
deadline=$((SECONDS + minutes * 60))

say() { echo "$*" | tee -a "$out/summary.txt"; }
bounded() {  # runs a command within the time left; timeout stops the command's whole process group
    local left=$((deadline - SECONDS))
    ((left > 5)) || { echo "gpu_proof.sh: no time left for: $*" >&2; return 124; }
    timeout -k 5 "$left" "$@" & wait $!  # waited for in the background, so that a signal is handled at once
}
descendants() { local child; for child in $(pgrep -P "$1"); do descendants "$child"; echo "$child"; done; }
trap 'say "## stopped by a signal at $SECONDS s"; kill $(descendants $$) 2>/dev/null; exit 130' INT TERM

gpu=$("$python" -c "import torch; print(torch.cuda.get_device_name(), 'torch', torch.__version__)")
say "# $gpu, within $minutes minutes"
bounded "$python" -m pytest -q -m cuda -p no:cacheprovider >"$out/cuda-tests.log" 2>&1; tests_rc=$?
say "## the cuda tests (rc $tests_rc, at $SECONDS s): $(tail -n 1 "$out/cuda-tests.log")"

greedy() {  # $1: the file stem, then sample.py's flags; one greedy text, with its log and exit status beside it
    local stem=$1; shift
    bounded "$python" sample.py "$@" --device cuda --seed 1 --temperature 0 --max-new-tokens 600 --prompt "ROMEO:" \
        >"$stem.txt" 2>"$stem.log"
    echo $? >"$stem.rc"
}

prove() {  # trains one model, samples from it nine ways and compares the texts; the status says whether they agree
    local pos=$1 dir=$out/$1 failed=0
    bounded "$python" train.py preset=gpu model.pos_emb=$pos train.max_iters=300 train.eval_interval=100 \
        hydra.run.dir=$dir >"$out/$pos.log" 2>&1 || { echo "## $pos: training failed"; tail -n 5 "$out/$pos.log"
                                                        return 1; }
    echo "## $pos, trained at $SECONDS s: $(tr '\r' '\n' <"$out/$pos.log" | grep "^step 300")"
    for precision in fp32 bf16 int8; do  # the samples run side by side: each is a small process on the GPU
        greedy "$dir/$precision-cached" --checkpoint "$dir" --precision $precision &
        greedy "$dir/$precision-uncached" --checkpoint "$dir" --precision $precision --no-kv-cache &
        greedy "$dir/$precision-compiled" --checkpoint "$dir" --precision $precision --compile &
    done
    wait
    for precision in fp32 bf16 int8; do
        echo "## $pos, $precision: $(tail -n 1 "$dir/$precision-cached.log")"
        local unfinished=0
        for way in cached uncached compiled; do
            local rc=$(cat "$dir/$precision-$way.rc")
            [ "$rc" = 0 ] && continue
            echo "   $way: did not finish (status $rc): $(tail -n 1 "$dir/$precision-$way.log")"
            unfinished=1 failed=1
        done
        ((unfinished)) && continue  # a text cut short proves nothing
        for other in uncached compiled; do
            if cmp -s "$dir/$precision-cached.txt" "$dir/$precision-$other.txt"; then
                echo "   $other: the same text"
            else
                echo "   $other: a different text ($(tail -n 1 "$dir/$precision-$other.log"))"
                [ $precision = fp32 ] && failed=1  # in fp32 the three must agree; lower precisions may drift
            fi
        done
        tail -n 3 "$dir/$precision-cached.txt"; echo
    done
    return $failed
}

# The two models train side by side on the GPU, each reporting into its own file.
prove learned >"$out/learned.proof" 2>&1 & learned=$!
prove rope >"$out/rope.proof" 2>&1 & rope=$!
wait $learned; learned_rc=$?
wait $rope; rope_rc=$?
cat "$out/learned.proof" "$out/rope.proof" | tee -a "$out/summary.txt"
say "## done at $SECONDS s: the cuda tests rc $tests_rc, learned rc $learned_rc, rope rc $rope_rc (0: proved)"
((tests_rc + learned_rc + rope_rc == 0))
