# Fourth GPU loan: run_all.py with the CPU kernels off (as loans 1-3) and built (the default
# wherever a compiler exists: pip's install builds them), decode and 200-ShareGPT throughput
# taking turns.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=.:/tmp/site || exit 1
export PIP_NO_INDEX=1 PYTHONUNBUFFERED=1
exec > >(tee $OUT/log.txt) 2>&1
R="python3 benchmarks/gpu/run_all.py --requests-file .gpu/sharegpt1000.json --num-prompts 200"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
python3 -c "import torch,triton,transformers;print('torch',torch.__version__,'triton',triton.__version__,'transformers',transformers.__version__)"
lscpu | grep -i "model name"; c++ --version | head -1
git log --oneline -1 2>/dev/null
T0=$SECONDS
echo "== off: correctness, micro, decode"; PAGEDLM_DISABLE_CPU_KERNELS=1 $R --phases correctness,micro,decode --budget-s 200 --out-dir $OUT/off 2>&1 | grep -v "Warning\|warn("
echo "== build at $((SECONDS-T0)) s"; time python3 pagedlm/csrc/build.py --wait
echo "== on: correctness, decode at $((SECONDS-T0)) s"; $R --phases correctness,decode --budget-s 150 --out-dir $OUT/on 2>&1 | grep -v "Warning\|warn("
for pass in 1 2; do
  s=""; [ $pass = 2 ] && s=2
  echo "== off$s throughput at $((SECONDS-T0)) s"; PAGEDLM_DISABLE_CPU_KERNELS=1 $R --phases throughput --throughput-runs pagedlm_graphs --budget-s 100 --out-dir $OUT/off$s 2>&1 | grep -v "Warning\|warn("
  echo "== on$s throughput at $((SECONDS-T0)) s"; $R --phases throughput --throughput-runs pagedlm_graphs --budget-s 100 --out-dir $OUT/on$s 2>&1 | grep -v "Warning\|warn("
done
rm -f $OUT/off2/results.md $OUT/on2/results.md
echo "== done at $((SECONDS-T0)) s"
