# Sourced by the scripts: preload OpenBLAS on Linux when present (MLX's CPU wheel
# otherwise uses a reference BLAS that is ~30x slower).
OPENBLAS=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0
if [ "$(uname -s)" = "Linux" ] && [ -e "$OPENBLAS" ] && [ -z "${MLX_REDRAFTER_NO_OPENBLAS:-}" ]; then
    export LD_PRELOAD="$OPENBLAS${LD_PRELOAD:+:$LD_PRELOAD}"
fi
