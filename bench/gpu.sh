#!/usr/bin/env bash
# The GPU half of the bench in one go, for a CUDA machine (bench/gpu.py says what it measures):
#
#   bench/gpu.sh                      # from the repository root or anywhere
#   OUT=/some/dir bench/gpu.sh        # results go to $OUT (default bench/results)
#
# Checks the GPU (nvidia-smi, torch.cuda.is_available()), prints GPU, driver and torch versions,
# then runs `python -m bench.gpu --device cuda` under `timeout`. Leaves in $OUT:
# <stamp>-gpu.json, <stamp>-gpu.md (rewritten after every section, so a run cut short keeps
# what it measured), gpu-env.txt (versions) and gpu-run.log (the whole output).
#
# Knobs (environment): PYTHON (default .venv/bin/python, made by `make venv`), GPU_BENCH_MIB
# (state size, default 2048), GPU_BENCH_REPEATS (default 3), GPU_BENCH_TIMEOUT (seconds,
# default 420; an H200 needs about 2-4 minutes), GPU_BENCH_TARGET (where checkpoints are
# written; default /dev/shm when it has room, else bench/out), GPU_BENCH_SECTIONS, and
# GPU_BENCH_DEVICE=cpu (a dry run of this script with the CPU stand-ins, for tests).
#
# Exit status: bench.gpu's (0 all sections ran and the resume verdict held, 1 not), 124 when
# the timeout cut it short, 2 when the Python environment is missing, 3 when there is no GPU.
set -uo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 2
OUT=${OUT:-bench/results}
MIB=${GPU_BENCH_MIB:-2048}
REPEATS=${GPU_BENCH_REPEATS:-3}
LIMIT=${GPU_BENCH_TIMEOUT:-420}
SECTIONS=${GPU_BENCH_SECTIONS:-d2h,blocking,fsdp_resume}
DEVICE=${GPU_BENCH_DEVICE:-cuda}
mkdir -p "$OUT" || exit 2

if [[ -n "${PYTHON:-}" ]]; then
    PY=$PYTHON
elif [[ -x .venv/bin/python ]]; then
    PY=.venv/bin/python
else
    cat >&2 <<'EOF'
bench/gpu.sh: no .venv here. Create it with `make venv` (needs the network: it installs
torch 2.13 and tierckpt[dev]; on Linux x86-64 pip's torch wheel is the CUDA build - check it
with `.venv/bin/python -c "import torch; print(torch.version.cuda)"`). Or point PYTHON at an
interpreter whose torch has CUDA (PYTHON=python3 bench/gpu.sh); it also needs crc32c, numpy
and torchdata (pip install crc32c numpy torchdata), and finds tierckpt in src/ if it is not
installed.
EOF
    exit 2
fi

if ! "$PY" -c "import torch" 2>/dev/null; then
    echo "bench/gpu.sh: $PY cannot import torch; run \`make venv\` or set PYTHON" >&2
    exit 2
fi
# tierckpt from this checkout when the interpreter has no install of it
if ! "$PY" -c "import tierckpt" 2>/dev/null; then
    export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONUNBUFFERED=1

{
    echo "== $(date -u +%Y-%m-%dT%H:%M:%SZ) $(hostname) $(uname -srm)"
    if command -v nvidia-smi >/dev/null; then
        nvidia-smi --query-gpu=name,driver_version,memory.total,pcie.link.gen.current,pcie.link.width.current \
            --format=csv || true
        nvidia-smi || true
    else
        echo "nvidia-smi: not on PATH (going by torch alone)"
    fi
    "$PY" - <<'EOF'
import importlib, sys
import torch
print(f"python {sys.version.split()[0]} ({sys.executable})")
print(f"torch {torch.__version__}, built for CUDA {torch.version.cuda}, "
      f"cuda available: {torch.cuda.is_available()}")
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print(f"device 0: {p.name}, sm {p.major}.{p.minor}, {p.total_memory / 2**30:.0f} GiB, "
          f"{torch.cuda.device_count()} visible; NCCL {torch.cuda.nccl.version()}")
missing = []
for name in ("numpy", "crc32c", "torchdata.stateful_dataloader", "tierckpt", "bench.gpu"):
    try:
        importlib.import_module(name)
    except Exception as e:
        missing.append(f"{name} ({type(e).__name__}: {e})")
print("missing: " + "; ".join(missing) if missing else "imports: all there")
EOF
} 2>&1 | tee "$OUT/gpu-env.txt"

if [[ "$DEVICE" == cpu ]]; then
    echo "bench/gpu.sh: GPU_BENCH_DEVICE=cpu: the CPU stand-ins (a dry run of this script)" >&2
elif ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "bench/gpu.sh: torch sees no CUDA device (a CPU build, or no GPU/driver here)." \
         "Install the CUDA build of torch into $PY's environment, or run the CPU stand-ins:" \
         "$PY -m bench.gpu --device cpu" >&2
    exit 3
fi
if grep -q "^missing: " "$OUT/gpu-env.txt"; then
    echo "bench/gpu.sh: some imports failed (see above); the sections that need them will" \
         "report an error, the others still run" >&2
fi

# Checkpoints on tmpfs when it holds ~6x the state (tierckpt's two + DCP's checkpoint and its
# shared-memory stagers): the numbers are C, not disk speed, and it keeps the run short.
TARGET=${GPU_BENCH_TARGET:-}
if [[ -z "$TARGET" ]]; then
    shm_free_kib=$(df -Pk /dev/shm 2>/dev/null | awk 'NR == 2 { print $4 }')
    if [[ -n "$shm_free_kib" && "$shm_free_kib" -gt $((MIB * 1024 * 6)) ]]; then
        TARGET=/dev/shm/tierckpt-gpu-bench-$$
    else
        TARGET=bench/out
    fi
fi
mkdir -p "$TARGET" || exit 2
[[ "$TARGET" == /dev/shm/* ]] && trap 'rm -rf "$TARGET"' EXIT
echo "checkpoints under $TARGET; results in $OUT; limit ${LIMIT}s"

timeout --kill-after=30 "$LIMIT" "$PY" -m bench.gpu --device "$DEVICE" --mib "$MIB" \
    --repeats "$REPEATS" --sections "$SECTIONS" --out "$OUT" --target "$TARGET" \
    2>&1 | tee "$OUT/gpu-run.log"
rc=${PIPESTATUS[0]}
[[ $rc -eq 124 ]] && echo "bench/gpu.sh: cut short after ${LIMIT}s; the JSON holds the" \
                         "sections that finished" >&2
ls -l "$OUT"
exit "$rc"
