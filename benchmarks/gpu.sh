#!/usr/bin/env bash
# The checks only a GPU machine can run, in one go: the CUDA tests, benchmarks.d2h, benchmarks.seed at
# 4 and 8 ranks on the GPU, and benchmarks.host at 2, 4 and 8 ranks. Everything it prints also goes
# to $OUT (default: ./gpu-out). SEED_METHODS, HOST_METHODS: the methods of each (default: all);
# D2H_RUN=0 leaves out benchmarks.d2h. BEFORE=DIR (an older tree, say `git archive` of a commit)
# also runs that tree's benchmarks.seed (loop and collector) at each world, right after this one's.
#
#   bash benchmarks/gpu.sh            # the full run (about 5 minutes on one H100 with 16 cores)
#   QUICK=1 bash benchmarks/gpu.sh    # tiny sizes: checks the script itself, on any machine
#
# Where the machine's python lacks tensordict, put its wheel (and pyvers', and zlib-ng's for the fast
# CRC-32: without it the standard library's is used) in .whl/ first: they are installed into
# /tmp/site, which goes on PYTHONPATH with the repository.
set -u
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
PY=${PY:-python3}
if ! $PY -c "import tensordict" 2>/dev/null; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site SITE=/tmp/site
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
log() { echo "== $*" | tee -a "$OUT/summary.txt"; }

log "machine ($(date -u +%H:%M:%S))"
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | head -2
  echo "$(nproc) cores, $(free -g | awk '/Mem:/{print $2}') GiB"
  $PY -c "import sys, torch, tensordict, safetensors; print(sys.version.split()[0], 'torch', torch.__version__, 'tensordict', tensordict.__version__, 'safetensors', safetensors.__version__, 'cuda', torch.cuda.is_available())"
} 2>&1 | tee -a "$OUT/summary.txt"

if [ -n "${QUICK:-}" ]; then
    SEED="--videos 3 --frames 5 --size 16 --batch 4 --repeats 1"; HOST="--mb 8 --repeats 1"; WORLDS="2"; HOSTW="2"
    D2H="--batches 4 --batch 4 --frame 3 16 16 --repeats 1"
else
    SEED="--videos 32 --frames 41 --size 128 --batch 32 --repeats 2"; HOST="--mb 300 --repeats 3"; WORLDS="4 8"; HOSTW="2 4 8"
    D2H="--batches 200 --batch 32 --frame 3 256 256 --repeats 3"
fi

log "CUDA tests"
timeout 240 $PY -m pytest -q -p no:cacheprovider tests/gpu "tests/test_ragged.py::test_a_cuda_ragged_batch_is_copied_to_the_host_once" \
    tests/test_write_threads.py 2>&1 \
    | tee "$OUT/cuda-tests.log" | tail -5 | tee -a "$OUT/summary.txt"

if [ "${D2H_RUN:-1}" != 0 ] && $PY -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    log "benchmarks.d2h $D2H"
    timeout 120 $PY -m benchmarks.d2h $D2H 2>&1 | tail -6 | tee -a "$OUT/summary.txt"
fi

for w in $WORLDS; do
    log "benchmarks.seed --world $w $SEED ${SEED_METHODS:+--methods $SEED_METHODS}"
    timeout 300 $PY -m benchmarks.seed --world "$w" $SEED ${SEED_METHODS:+--methods $SEED_METHODS} --out "$OUT/w$w" 2>&1 | tail -14 | tee -a "$OUT/summary.txt"
    if [ -n "${BEFORE:-}" ]; then
        log "BEFORE=$BEFORE: benchmarks.seed --world $w $SEED --methods loop collector ($(date -u +%H:%M:%S))"
        (cd "$BEFORE" && export PYTHONPATH="$PWD${SITE:+:$SITE}" \
            && $PY -c "import tdgather; print('tdgather from', tdgather.__file__)" \
            && timeout 300 $PY -m benchmarks.seed --world "$w" $SEED --methods loop collector \
            --out "$OUT/before-w$w" 2>&1 | tail -5) 2>&1 | tee -a "$OUT/summary.txt"
    fi
done

log "($(date -u +%H:%M:%S)) benchmarks.host --world $HOSTW $HOST ${HOST_METHODS:+--methods $HOST_METHODS}"
timeout 300 $PY -m benchmarks.host --world $HOSTW $HOST ${HOST_METHODS:+--methods $HOST_METHODS} --dir "${TMPDIR:-/tmp}" 2>&1 | tail -16 | tee -a "$OUT/summary.txt"

log "benchmarks.stages collector (rank 0's stages at the largest world)"
W=${HOSTW##* }
timeout 120 $PY -m benchmarks.stages collector ${QUICK:+8}${QUICK:-300} --world "$W" --repeats 2 2>&1 | sed -n 1,26p | tee -a "$OUT/summary.txt"
log "end ($(date -u +%H:%M:%S))"
