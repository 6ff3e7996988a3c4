#!/usr/bin/env bash
# Run on the GPU machine (the device tool), from the repository root:
#   bash scripts/gpu_check.sh tests            GPU-marked tests + the interpreter-free corpus checks
#   bash scripts/gpu_check.sh bench GROUP...   einfold bench for these groups (one run, side by side)
#   bash scripts/gpu_check.sh fuzz N           the fuzzer with N examples per property
#   bash scripts/gpu_check.sh compare NAME[,NAME] GROUP...  this tree against earlier revisions in .before/ (scripts/compare_revisions.py)
# Wheels the machine lacks (lark, pytest, hypothesis) travel in .whl/ (carry it).
# Logs and results go to $OUT (or ./gpu-out); the last lines printed are a short summary.
set -uo pipefail
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site:$PWD || exit 1
else
    export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1 EINFOLD_CACHE_DIR=/tmp/einfold-cache
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name(0))"
what=${1:-tests}; shift || true
case "$what" in
    tests)
        # LIMIT (s, optional): each shard is interrupted then and reports what ran.
        # SHARDS pytest processes side by side (compiling and autotuning are CPU-bound; the
        # GPU is idle most of the time), each with its own kernel cache and log.
        shards=${SHARDS:-1}
        work=$(mktemp -d)
        # IDS (optional): a file of node ids, one per line, to run instead of every GPU test;
        # EXCLUDE (optional): an extended regular expression of node ids to leave out, e.g.
        # 'differential|distributed|test_the_hopper_form' (the corpus and two-GPU tests take calls of their own)
        if [ -n "${IDS:-}" ]; then cp "$IDS" "$work/ids"; else
            python3 -m pytest -p no:cacheprovider -m gpu -q --collect-only tests 2>/dev/null | grep '::' > "$work/ids"; fi
        if [ -n "${EXCLUDE:-}" ]; then grep -Ev "$EXCLUDE" "$work/ids" > "$work/ids.kept"; mv "$work/ids.kept" "$work/ids"; fi
        echo "$(wc -l < "$work/ids") GPU tests in $shards shard(s)"
        for ((s = 0; s < shards; s++)); do
            awk -v n="$shards" -v s="$s" '(NR - 1) % n == s' "$work/ids" > "$work/ids.$s"
            # node ids hold spaces: one per line, passed whole
            # -v names each test as it ends; a test past 150 s dumps its stack (faulthandler)
            tr '\n' '\0' < "$work/ids.$s" | EINFOLD_CACHE_DIR=/tmp/einfold-cache-$s \
                xargs -0 timeout -s INT -k 30 "${LIMIT:-0}" python3 -m pytest -p no:cacheprovider -m gpu -rA -v --durations=15 \
                -o faulthandler_timeout=150 > "$work/log.$s" 2>&1 &
        done
        wait
        cat "$work"/log.* > "$OUT/gpu_tests.log"
        grep -hE '^(FAILED|ERROR)' "$work"/log.* | cut -c1-300
        grep -hE '^differential corpus|^=+ .*(passed|failed)' "$work"/log.* ;;
    bench)
        args=(); for g in "$@"; do args+=(--group "$g"); done
        python3 -m compiler bench "${args[@]}" --out "$OUT/bench" 2>&1 | tee "$OUT/bench.log" | tail -60 ;;
    fuzz)
        EINFOLD_FUZZ_EXAMPLES=${1:-2000} python3 -m pytest -p no:cacheprovider -rA --hypothesis-show-statistics tests/test_fuzz.py 2>&1 \
            | tee "$OUT/fuzz.log" | tail -30 ;;
    compare)
        python3 scripts/compare_revisions.py "$@" 2>&1 | tee "$OUT/compare.log" | tail -30 ;;
    *) echo "unknown step: $what"; exit 2 ;;
esac
