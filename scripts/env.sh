# Sourced by the scripts: fast fp32 matmuls for MLX's Linux CPU backend, whose wheel
# otherwise uses a reference BLAS that is ~30x slower. The system OpenBLAS is preloaded;
# with the sgemm router built by scripts/setup (scripts/blas/sgemm_router.c) in front
# of it, products of 1-16 rows with a weight matrix (decoding, verifying a tree) go to
# the router's own kernel (scripts/blas/skinny_sgemm.c), other single-row ones to the
# system OpenBLAS and the rest to OpenBLAS 0.3.34 (docs/performance.md).
# MLX_REDRAFTER_SKINNY_ROWS=0 turns the kernel off; MLX_REDRAFTER_NO_OPENBLAS=1 keeps the reference BLAS;
# MLX_REDRAFTER_NO_ROUTER=1 uses the system OpenBLAS alone. Source it from the
# repository root or with bash (which tells it where it lives).
OPENBLAS=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0
ROUTER="$(cd -P -- "$(dirname -- "${BASH_SOURCE:-$0}")/.." 2>/dev/null >&2 && pwd)/.venv/lib/libsgemm_router.so"
[ -e "$ROUTER" ] || ROUTER="$PWD/.venv/lib/libsgemm_router.so"
if [ "$(uname -s)" = "Linux" ] && [ -e "$OPENBLAS" ] && [ -z "${MLX_REDRAFTER_NO_OPENBLAS:-}" ]; then
    if [ -e "$ROUTER" ] && [ -z "${MLX_REDRAFTER_NO_ROUTER:-}" ]; then
        export LD_PRELOAD="$ROUTER:$OPENBLAS${LD_PRELOAD:+:$LD_PRELOAD}"
        # Two OpenBLAS thread pools share the cores: idle workers must not spin long
        # (2^10 cycles), or a step alternating one-row and multi-row products slows
        # down (docs/performance.md).
        export OPENBLAS_THREAD_TIMEOUT="${OPENBLAS_THREAD_TIMEOUT:-10}"
    else
        export LD_PRELOAD="$OPENBLAS${LD_PRELOAD:+:$LD_PRELOAD}"
    fi
fi
