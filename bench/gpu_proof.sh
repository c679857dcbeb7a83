#!/usr/bin/env bash
# The GPU proof, in one short run on a fresh CUDA machine: bash bench/gpu_proof.sh [minutes, 8 unless given]
# 1. Decoding speed, every path in one process (bench/gpu_decode.py), at batches 1 and 64: kvgpt eager, captured
#    by hand as a CUDA graph, compiled with reduce-overhead, the engine's bucket graphs and uncached, in fp32, bf16
#    and int8; Hugging Face's GPT-2 eager and with a static cache compiled; a profile of the uncached step.
# 2. The cuda tests (python -m pytest -m cuda).
# 3. The main job, python train.py: its wall time, best val loss and last val loss.
# 4. Its checkpoint's fp32 greedy text cached, uncached and through the captured step, compared.
# Everything goes into one folder, flat, at most 8 files: $OUT if set, else runs/gpu-proof/<date>_<time>.
# summary.txt grows as each stage ends, so a run cut short still says what it measured.
# Where there is no package index: run ../shared/gpu/prepare.sh before, and carry .gpu-site and datasets along;
# this script puts .gpu-site on PYTHONPATH, and takes tiny_shakespeare from KVGPT_DATA_URL (a file:// URL) when
# datasets/ lacks it. PYTHON names the interpreter where `python` is not the one with torch.
set -uo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python}
minutes=${1:-8}
refuse() { echo "gpu_proof.sh: error: $*" >&2; exit 2; }
[[ $minutes =~ ^[1-9][0-9]*$ ]] || refuse "minutes must be a whole number above 0, got '$minutes'"
"$python" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null \
    || refuse "$python finds no CUDA device (or no torch); run it on a CUDA machine, PYTHON naming the interpreter"
[ -d .gpu-site ] && export PYTHONPATH="$PWD/.gpu-site${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
data=datasets/tiny_shakespeare/input.txt
if [ ! -f "$data" ] && [[ ${KVGPT_DATA_URL:-} == file://* ]]; then
    mkdir -p "$(dirname "$data")" && cp "${KVGPT_DATA_URL#file://}" "$data" || refuse "cannot copy $KVGPT_DATA_URL to $data"
fi
out=${OUT:-runs/gpu-proof/$(date +%Y-%m-%d_%H-%M-%S)}
mkdir -p "$out" 2>/dev/null || refuse "cannot create $out; run it where it can be written"
run=runs/gpu-proof-run  # train.py's own folder: its checkpoints stay out of $out
rm -rf "$run"
deadline=$((SECONDS + minutes * 60))

say() { echo "$*" | tee -a "$out/summary.txt"; }
bounded() {  # bounded SECONDS COMMAND...: within those seconds and the time left; timeout stops its process group
    local left=$((deadline - SECONDS)); (($1 < left)) && left=$1; shift
    ((left > 5)) || { echo "gpu_proof.sh: no time left for: $*" >&2; return 124; }
    timeout -k 5 "$left" "$@" & wait $!  # waited for in the background, so that a signal is handled at once
}
descendants() { local child; for child in $(pgrep -P "$1"); do descendants "$child"; echo "$child"; done; }
trap 'say "## stopped by a signal at $SECONDS s"; kill $(descendants $$) 2>/dev/null; exit 130' INT TERM

say "# $("$python" -c "import torch; print(torch.cuda.get_device_name(), 'torch', torch.__version__)"), within $minutes minutes"

bounded 200 "$python" bench/gpu_decode.py >"$out/decode.md" 2>&1; decode_rc=$?
say "## decoding speed (rc $decode_rc, at $SECONDS s)"; cat "$out/decode.md" >>"$out/summary.txt"

bounded 80 "$python" -m pytest -q -m cuda -p no:cacheprovider >"$out/cuda-tests.log" 2>&1; tests_rc=$?
say "## the cuda tests (rc $tests_rc, at $SECONDS s): $(tail -n 1 "$out/cuda-tests.log")"

start=$SECONDS
bounded 170 "$python" train.py hydra.run.dir="$run" >"$out/train.log" 2>&1; train_rc=$?
say "## python train.py (rc $train_rc), $((SECONDS - start)) s start to end: $(tr '\r' '\n' <"$out/train.log" | grep "^done:" | tail -n 1)"

texts_rc=1
if [ "$train_rc" = 0 ]; then
    for way in cached uncached captured; do
        flags=(); [ $way = uncached ] && flags=(--no-kv-cache); [ $way = cached ] && flags=(--no-compile)
        bounded 20 "$python" sample.py --checkpoint "$run" --device cuda --temperature 0 --max-new-tokens 600 \
            --prompt "ROMEO:" "${flags[@]}" >"$out/text-$way.txt" 2>>"$out/texts.log"
    done
    if cmp -s "$out/text-cached.txt" "$out/text-uncached.txt" && cmp -s "$out/text-cached.txt" "$out/text-captured.txt"
    then texts_rc=0; say "## fp32 greedy text: the same cached, uncached and captured (600 tokens)"
    else say "## fp32 greedy text: NOT the same cached, uncached and captured (see text-*.txt)"; fi
    grep "tokens in" "$out/texts.log" | sed 's/^/   /' | tee -a "$out/summary.txt" >/dev/null
fi
say "## done at $SECONDS s: decode rc $decode_rc, cuda tests rc $tests_rc, train rc $train_rc, texts rc $texts_rc"
((decode_rc + tests_rc + train_rc + texts_rc == 0))
