#!/usr/bin/env bash
# One call on the GPU machine: build the extension, run the GPU tests, then the benchmarks
# (tables last). Logs go to $OUT. Wheels the machine lacks (expecttest, torchao) travel in .whl/.
#   bash benchmarks/gpu.sh [build] [tests] [mixed] [gemm] [blockgemm] [grouped] [grouped_quantize] [experts] [probe] [quantize] [inductor] [cast] [host] [inference] [decode] [attention] [ncu] [train ARGS...|generate ARGS...|sweep ARGS...|moe ARGS...]
# ncu: hardware counters of the MXFP8 rowwise and both-directions and the NVFP4 both-directions
# quantize kernels (shared-memory bank conflicts, scheduler statistics, stall reasons and pipe
# utilization: whether a kernel is bound by memory or by issuing instructions).
set -uo pipefail
export PYTHONUNBUFFERED=1 MAX_JOBS=16 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
fi
# Without the editable install (the build step), passes/ is importable as graphquant.passes by a link.
[ -e graphquant/passes ] || ln -s ../passes graphquant/passes
steps=("$@"); [ ${#steps[@]} -eq 0 ] && steps=(build tests gemm quantize train)
nvidia-smi --query-gpu=name,clocks.sm,memory.used --format=csv | tee "$OUT/gpu.txt"
for i in "${!steps[@]}"; do
  case "${steps[$i]}" in
    build) /usr/bin/time -f "build: %e s" python3 -m pip install --no-build-isolation --no-deps -e . > "$OUT/build.log" 2>&1; tail -3 "$OUT/build.log"
           python3 -c "import graphquant, graphquant._C as C; print('cuda kernels built:', C.cuda_built)" ;;
    tests) python3 -m pytest -q -m gpu ${GQ_TESTS:-tests} 2>&1 | tee "$OUT/gpu_tests.log" | tail -30 ;;
    gemm) python3 benchmarks/gemm.py 2>&1 | tee "$OUT/gemm.txt" ;;
    blockgemm) python3 benchmarks/block_gemm.py 2>&1 | tee "$OUT/block_gemm.txt" ;;
    grouped) python3 benchmarks/grouped_gemm.py --promote fast,128 2>&1 | tee "$OUT/grouped_gemm.txt" ;;
    grouped_quantize) python3 benchmarks/grouped_quantize.py 2>&1 | tee "$OUT/grouped_quantize.txt" ;;
    experts) python3 benchmarks/grouped_decode.py 2>&1 | tee "$OUT/grouped_decode.txt" ;;
    probe) python3 benchmarks/accumulation_probe.py 2>&1 | tee "$OUT/accumulation_probe.txt" ;;
    quantize) # GRAPHQUANT_REGISTER_TILE=0 (the generic tile program alone) writes its own table
              python3 benchmarks/quantize.py 2>&1 | tee "$OUT/quantize${GRAPHQUANT_REGISTER_TILE+_register_tile_$GRAPHQUANT_REGISTER_TILE}.txt" ;;
    inductor) python3 benchmarks/inductor_quantize.py 2>&1 | tee "$OUT/inductor_quantize.txt" ;;
    cast) python3 benchmarks/saturating_cast.py 2>&1 | tee "$OUT/saturating_cast.txt" ;;
    host) python3 benchmarks/host_overhead.py 2>&1 | tee "$OUT/host_overhead.txt" ;;
    inference) python3 benchmarks/inference_weights.py 2>&1 | tee "$OUT/inference_weights.txt" ;;
    decode) python3 benchmarks/decode_gemm.py 2>&1 | tee "$OUT/decode_gemm.txt" ;;
    mixed) # the mixed-input wgmma GEMM (MXFP8's and NVFP4's middle rows on Hopper): its tests, then both formats beside bf16 and the decode GEMM
           python3 -m pytest -q tests/test_mixed_gemm_gpu.py 2>&1 | tee "$OUT/mixed_tests.log" | tail -5
           python3 benchmarks/decode_gemm.py --rows 16,64,128,512,2048 --formats mxfp8,nvfp4 --weights 14336x4096,4096x14336 2>&1 | tee "$OUT/mixed_gemm.txt" ;;
    attention) python3 benchmarks/attention.py 2>&1 | tee "$OUT/attention.txt" ;;
    ncu) for kernel in InBF16ELi4ELi0E InBF16ELi4ELi4E InBF16ELi5ELi5E; do  # MXFP8 rowwise, both; NVFP4 both (first launch of each)
           ncu --clock-control none --kernel-name-base mangled -k "regex:$kernel" --launch-count 1 \
             --section SpeedOfLight --section MemoryWorkloadAnalysis --section MemoryWorkloadAnalysis_Tables \
             --section Occupancy --section WarpStateStats --section SchedulerStats \
             --section ComputeWorkloadAnalysis --section InstructionStats \
             --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio,regex:sm__inst_executed_pipe_.*\.avg\.pct_of_peak_sustained_active" \
             python3 benchmarks/quantize.py --shapes 16384x4096 --reps 1
         done > "$OUT/ncu.txt" 2>&1
         grep -E "tile_kernel|Throughput|Achieved Occupancy|Theoretical Occupancy|Block Limit|Duration|Mem Busy|Eligible|Issued Warp|bank conflict|Executed Ipc|Issue Slots" "$OUT/ncu.txt" | head -80
         awk '/tile_kernel/ {print} /issue_stalled/ && $NF + 0 > 0.2 {print "   ", $1, $NF} /inst_executed_pipe/ && $NF + 0 > 5 {print "   ", $1, $NF}' "$OUT/ncu.txt" ;;
    moe) python3 benchmarks/moe_step.py "${steps[@]:$((i+1))}" 2>&1 | tee "$OUT/moe_step.txt"
         break ;;
    train) # SM clock and power every 200 ms: FP8 GEMMs are power-bound, so clocks explain drift
           nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu --format=csv,noheader -lms 200 > "$OUT/clocks.csv" &
           python3 benchmarks/train_step.py "${steps[@]:$((i+1))}" 2>&1 | tee "$OUT/train_step.txt"
           kill $!; sort -t, -k2 -n "$OUT/clocks.csv" | awk -F, '{c[NR]=$2} END {print "SM clock (MHz) over the run: min", c[1], "median", c[int(NR/2)+1], "max", c[NR]}'
           break ;;
    generate) # transformers and its dependencies travel as wheels in .whl/ (NOTES.md, generate.py)
              python3 benchmarks/generate.py "${steps[@]:$((i+1))}" 2>&1 | tee "$OUT/generate.txt"
              break ;;
    sweep) python3 benchmarks/inference_sweep.py "${steps[@]:$((i+1))}" 2>&1 | tee "$OUT/inference_sweep.txt"
           break ;;
  esac
done
