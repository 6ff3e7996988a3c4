# issue 14 on a machine of two GPUs or more: the NCCL test, then the distributed benchmark
# (a benchmark past BENCH_SECONDS gets SIGUSR1 first: each rank prints its Python stack into the log)
set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD EINFOLD_CACHE_DIR=/tmp/einfold-cache PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
nvidia-smi -L
if [ "${TEST_SECONDS:-150}" != 0 ]; then       # TEST_SECONDS=0: the benchmark only
  s=$(date +%s)
  timeout ${TEST_SECONDS:-150} python3 -m pytest -p no:cacheprovider -q -m gpu tests/test_distributed.py > $OUT/nccl_tests.log 2>&1
  echo "NCCL tests rc=$? $(( $(date +%s) - s ))s: $(tail -1 $OUT/nccl_tests.log)"
  grep -E "^E " $OUT/nccl_tests.log | head -8
fi
s=$(date +%s)
timeout -s USR1 -k 15 ${BENCH_SECONDS:-400} python3 -m compiler bench --group distributed ${BENCH_ARGS:-} --out $OUT > $OUT/bench_distributed.log 2>&1
echo "distributed bench rc=$? $(( $(date +%s) - s ))s"
tail -${BENCH_LINES:-25} $OUT/bench_distributed.log
