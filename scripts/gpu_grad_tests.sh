set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD EINFOLD_CACHE_DIR=/tmp/einfold-cache PYTHONUNBUFFERED=1
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name(0))"
for c in attention causal bias gqa layernorm cross_entropy; do
  s=$(date +%s)
  timeout 120 python3 -m pytest -p no:cacheprovider -q -m gpu "tests/test_grad.py::test_gpu_bf16_gradients_are_as_accurate_as_torch[$c]" > $OUT/grad_$c.log 2>&1
  rc=$?
  echo "grad[$c] rc=$rc $(( $(date +%s) - s ))s $(grep -E 'passed|failed' $OUT/grad_$c.log | tail -1)"
  grep -E "^E " $OUT/grad_$c.log | head -4
done
s=$(date +%s)
timeout 330 python3 -m pytest -p no:cacheprovider -q -m gpu tests/test_triton_backend.py tests/test_backend_regressions.py tests/test_grad.py -k "not test_gpu_bf16_gradients" > $OUT/gpu_rest.log 2>&1
echo "other gpu tests rc=$? $(( $(date +%s) - s ))s: $(tail -1 $OUT/gpu_rest.log)"
grep -E "^FAILED|^ERROR" $OUT/gpu_rest.log | head
# the torch integration tests (custom ops, opcheck, torch.compile, the cache across processes), on the GPU
s=$(date +%s)
timeout 300 python3 -m pytest -p no:cacheprovider -q tests/test_grad.py -k "opcheck or one_graph or new_process or only_inputs" > $OUT/torch_integration.log 2>&1
echo "torch integration tests rc=$? $(( $(date +%s) - s ))s: $(tail -1 $OUT/torch_integration.log)"
grep -E "^FAILED|^ERROR" $OUT/torch_integration.log | head
