#!/usr/bin/env bash
# GPU check (issue #19), on a machine with a CUDA GPU:   deploy/gpu_check.sh OUTDIR
#
#  1. a Python environment with CUDA torch: .venv when its torch already sees the GPU, else
#     .venv-gpu (GPU_CHECK_VENV) with `pip install -e .[dev]` (PyPI's Linux torch wheels are CUDA
#     builds; TORCH_INDEX_URL picks another index, e.g. https://download.pytorch.org/whl/cu124);
#  2. the CUDA-marked tests (tests/test_cuda_graphs.py: graph vs eager decode, engine vs offline
#     generate, bf16/fp16 vs float32 BLEU on test_2016_flickr within 0.3);
#  3. the encoder's bf16 rate against the GPU's bf16 matmul rate (random `base` model, large batch);
#  4. python -m service.bench_engine --device cuda, parts b, c and e, for the shipped model and a
#     random-weight `base` model (6+6 layers, d_model 512);
#  then one table (OUTDIR/table.txt). Every step has a timeout; the whole run stays under 8 minutes
#  (GPU_CHECK_BUDGET_S, default 470 s). Logs: OUTDIR/*.log; summary: OUTDIR/summary.txt.
# Exit status: 0 all steps passed, 1 a step failed or timed out, 2 no GPU / bad usage.
set -uo pipefail

OUT=${1:?usage: deploy/gpu_check.sh OUTDIR}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/.."
BUDGET=${GPU_CHECK_BUDGET_S:-470}
START=$SECONDS
STATUS=0
: > "$OUT/summary.txt"

note() { echo "$*" | tee -a "$OUT/summary.txt"; }

# step NAME SECONDS CMD...: run with a timeout capped by the time left; log to OUTDIR/NAME.log
step() {
    local name=$1 limit=$2 left rc t0=$SECONDS
    shift 2
    left=$((BUDGET - (SECONDS - START)))
    ((limit > left)) && limit=$left
    if ((limit < 15)); then
        note "SKIP  $name: out of time (budget ${BUDGET}s)"; STATUS=1; return 1
    fi
    timeout --kill-after=10 "$limit" "$@" >"$OUT/$name.log" 2>&1
    rc=$?
    if ((rc == 0)); then note "OK    $name ($((SECONDS - t0)) s)"
    elif ((rc == 124 || rc == 137)); then note "TIME  $name: killed after ${limit} s"; STATUS=1
    else note "FAIL  $name: exit $rc (see $name.log)"; STATUS=1
    fi
    return $rc
}

if ! command -v nvidia-smi >/dev/null || ! nvidia-smi -L >"$OUT/gpu.txt" 2>&1; then
    echo "no CUDA GPU here (nvidia-smi -L failed); nothing to check" >&2
    exit 2
fi
note "GPU: $(head -n1 "$OUT/gpu.txt"); $(date -u +%Y-%m-%dT%H:%MZ)"

# ---- 1. environment ----------------------------------------------------------------------------
PY=.venv/bin/python
if ! [ -x "$PY" ] || ! timeout 60 "$PY" -c 'import sys, torch; sys.exit(not torch.cuda.is_available())' 2>/dev/null; then
    VENV=${GPU_CHECK_VENV:-.venv-gpu}
    PY=$VENV/bin/python
    install() {
        [ -x "$PY" ] || python3 -m venv "$VENV" || return 1
        "$PY" -m pip install -q --upgrade pip || return 1
        if [ -n "${TORCH_INDEX_URL:-}" ]; then
            "$PY" -m pip install -q torch --index-url "$TORCH_INDEX_URL" || return 1
        fi
        "$PY" -m pip install -q -e '.[dev]' || return 1
        "$PY" -c 'import sys, torch; print(torch.__version__, torch.version.cuda); sys.exit(not torch.cuda.is_available())'
    }
    step install 240 install || { note "no CUDA torch: see install.log"; exit 1; }
fi
"$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name())' \
    | tee -a "$OUT/summary.txt"

# ---- 2. CUDA-marked tests ----------------------------------------------------------------------
step cuda_tests 150 "$PY" -m pytest -q -p no:cacheprovider -m cuda -rs -s tests/test_cuda_graphs.py
grep -E "BLEU test_2016_flickr|passed|failed|skipped" "$OUT/cuda_tests.log" | tee -a "$OUT/summary.txt"

# ---- 3. encoder rate against the matmul rate -------------------------------------------------
step encoder_rate 40 "$PY" - <<'EOF'
import time, torch
from model.config import ModelConfig
from model.transformer import Transformer, padding_mask

def rate(fn, flops, n=20):
    fn(); torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return flops * n / (time.perf_counter() - t) / 1e12

torch.set_grad_enabled(False)
a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
peak = rate(lambda: a @ a, 2 * 8192 ** 3)
cfg = ModelConfig.from_name("base", vocab_size=8000)
m = Transformer(cfg).cuda().to(torch.bfloat16).eval()
B, S, d, L = 512, 32, cfg.d_model, cfg.n_encoder_layers
src = torch.randint(4, 8000, (B, S), device="cuda")
mask = padding_mask(src, cfg.pad_id)
flops = L * (2 * B * S * (4 * d * d + 2 * d * cfg.d_ff) + 4 * B * S * S * d)   # projections, FFN, attention
enc = rate(lambda: m.encode(src, mask), flops)
print(f"bf16 matmul 8192^3: {peak:.0f} TFLOP/s; base encoder, batch {B} x {S} tokens: {enc:.0f} TFLOP/s "
      f"= {enc / peak:.0%} of the matmul rate (target >= 50%)")
EOF
tail -n1 "$OUT/encoder_rate.log" | tee -a "$OUT/summary.txt"

# ---- 4. engine benchmark: shipped model and random base ------------------------------------------
BENCH=(-m service.bench_engine --device cuda --parts b,c,e --beams 1,4 --layouts 1x1 --threads 1 --engine-slots 256)
step bench_shipped 110 "$PY" "${BENCH[@]}"
step bench_base 110 "$PY" "${BENCH[@]}" --preset base

# ---- one table ---------------------------------------------------------------------------------
{
    echo "GPU check $(date -u +%Y-%m-%d): $(head -n1 "$OUT/gpu.txt")"
    printf '%-8s %-5s %-42s %-8s %9s %9s %8s %8s\n' model part system decoding sent/s tok/s "p50 ms" "p99 ms"
    for m in shipped base; do
        [ -f "$OUT/bench_$m.log" ] || continue
        grep -E '^\((b|c|e)\) ' "$OUT/bench_$m.log" | awk -v m="$m" '{
            n = NF; last = n - 5; dec = $(n-4)
            if ($(n-5) == "beam") { dec = "beam " $(n-4); last = n - 6 }
            if ($last == "1x1") last--
            sys = ""; for (i = 2; i <= last; i++) sys = sys (sys ? " " : "") $i
            printf "%-8s %-5s %-42s %-8s %9s %9s %8s %8s\n", m, $1, substr(sys, 1, 42), dec, $(n-3), $(n-2), $(n-1), $n }'
        grep -E 'continuous/static' "$OUT/bench_$m.log" | sed "s/^/  $m: /"
    done
    grep -h -E 'TFLOP/s|BLEU test_2016_flickr' "$OUT/encoder_rate.log" "$OUT/cuda_tests.log" 2>/dev/null
} >"$OUT/table.txt"
echo
cat "$OUT/table.txt"
note "total $((SECONDS - START)) s; exit $STATUS"
exit $STATUS
