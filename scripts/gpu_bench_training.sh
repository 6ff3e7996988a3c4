# bench groups one after another, each under its own time limit: GROUP:SECONDS ...
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD EINFOLD_CACHE_DIR=/tmp/einfold-cache PYTHONUNBUFFERED=1
for spec in "$@"; do
  g=${spec%%:*}; t=${spec##*:}
  timeout $t python3 -m compiler bench --group $g --quick --out $OUT/$g > $OUT/bench_$g.log 2>&1
  echo "== $g rc=$?"; grep -v "^\s*$" $OUT/bench_$g.log | tail -30
done
