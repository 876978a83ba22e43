#!/usr/bin/env bash
# One device call on the lent H200: install the carried wheels (fla-core 0.6.0), then run
# the named steps, each under its own time limit, logging everything under $OUT.
#   usage: benchmarks/h200_session.sh STEP[:SECONDS] ...
#   steps: info, gluon_stages, gluon_sm90, fused, profile, triton_generic, so_configs, so_configs_l2, wy_variants, host,
#          bench, bench_l2, pytest_gpu
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1 || echo "wheel install failed"
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 FLA_FLASH_QLA=0
for spec in "$@"; do
    step=${spec%%:*}; limit=${spec#*:}; [ "$limit" = "$spec" ] && limit=300
    echo "=== $step (limit ${limit}s) $(date +%T)"
    case $step in
        info) nvidia-smi -L; python3 -c "import torch, triton; print(torch.__version__, triton.__version__)"; python3 -m gdn_dispatch info ;;
        gluon_stages) timeout "$limit" python3 benchmarks/h200_gluon_stages.py ;;
        gluon_sm90) GDN_H200_BUDGET_S=$((limit - 25)) timeout "$limit" python3 benchmarks/h200_gluon_sm90.py ;;
        fused) timeout "$limit" python3 benchmarks/h200_gluon_fused.py --budget $((limit - 30)) ;;
        profile) timeout "$limit" python3 benchmarks/h200_profile.py --budget $((limit - 30)) ;;
        triton_generic) timeout "$limit" python3 benchmarks/h200_triton_generic.py --budget $((limit - 30)) ${TG_ARGS:-} ;;
        so_configs) timeout "$limit" python3 benchmarks/h200_state_output_configs.py --budget $((limit - 30)) ;;
        so_configs_l2) timeout "$limit" python3 benchmarks/h200_state_output_configs.py --l2 --budget $((limit - 30)) ;;
        wy_variants) timeout "$limit" python3 benchmarks/h200_wy_variants.py --budget $((limit - 30)) ;;
        host) timeout "$limit" python3 benchmarks/h200_host_profile.py ;;
        bench) timeout "$limit" python3 -m gdn_dispatch bench --check --json "$OUT/bench.json" --plot "$OUT/bench.png" ;;
        bench_l2) timeout "$limit" python3 -m gdn_dispatch bench --check --qk-l2norm --json "$OUT/bench_l2.json" --plot "$OUT/bench_l2.png" ;;
        pytest_gpu) timeout "$limit" python3 -m pytest -q -rf -m gpu tests/ ;;
        *) echo "unknown step $step" ;;
    esac 2>&1 | tee "$OUT/$step.log" | tail -n 60
    echo "=== $step rc=${PIPESTATUS[0]}"
done
