/*
 * sgemm_router: an LD_PRELOAD shim for MLX's Linux CPU backend that sends each fp32
 * matrix product to the BLAS that is faster at its shape on this machine.
 *
 * MLX's CPU backend calls cblas_sgemm for every fp32 matmul. One-token decoding
 * multiplies a single row by each weight matrix; verifying a tree multiplies a few
 * rows (2..16). On the benchmark machine (AMD EPYC, Zen 5) Debian's OpenBLAS 0.3.21
 * is fastest for single rows but spends 1.5-1.8x the single-row time on 3-8 rows,
 * while OpenBLAS 0.3.34 (the scipy-openblas32 wheel, whose symbols carry a scipy_
 * prefix) does 3-8 rows in about the single-row time but is slower on single rows.
 * Routing by shape gives every caller the faster one. docs/performance.md has the
 * measurements (scripts/blas/shapes.py times the shapes).
 *
 * Products of 1-16 rows with a transposed weight matrix (every linear layer while
 * decoding or verifying a tree, the mlx-lm baseline's included) go to neither:
 * skinny_sgemm.c streams the weights once, 1.5-2.5x faster than either OpenBLAS at
 * these shapes here, and gives a row the same bits whatever the number of rows.
 * MLX_REDRAFTER_SKINNY_ROWS=0 turns it off (or sets the largest row count it takes);
 * MLX_REDRAFTER_SGEMM_THREADS sets its threads (default: OPENBLAS_NUM_THREADS, else
 * the online CPUs) and MLX_REDRAFTER_SGEMM_SPIN
 * how long an idle helper thread busy-waits before it sleeps (pause instructions,
 * default 20000).
 *
 * Build (scripts/setup does): gcc -O3 -shared -fPIC sgemm_router.c skinny_sgemm.c
 *   -o libsgemm_router.so
 *   -ldl -lpthread -DSINGLE_ROW_BLAS='"/path/libopenblas.so.0"'
 *   -DMULTI_ROW_BLAS='"/path/libscipy_openblas.so"'
 * The paths can be overridden at run time with MLX_REDRAFTER_SINGLE_ROW_BLAS and
 * MLX_REDRAFTER_MULTI_ROW_BLAS. If a library cannot be loaded, the router says so once
 * and sends those products to the next cblas_sgemm in the search order (the system
 * OpenBLAS that scripts/env.sh preloads after it, or MLX's own BLAS).
 */
#define _GNU_SOURCE /* RTLD_NEXT */
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include "skinny_sgemm.h"

typedef int blas_int;
typedef void (*sgemm_fn)(int, int, int, blas_int, blas_int, blas_int, float, const float *,
                         blas_int, const float *, blas_int, float, float *, blas_int);
typedef void (*dgemm_fn)(int, int, int, blas_int, blas_int, blas_int, double, const double *,
                         blas_int, const double *, blas_int, double, double *, blas_int);

static sgemm_fn single_row_sgemm, multi_row_sgemm;
static dgemm_fn multi_row_dgemm;
static pthread_once_t loaded = PTHREAD_ONCE_INIT;
static int skinny_max_rows; /* 0: skinny_sgemm off */

static int setting(const char *variable, int fallback) {
  const char *value = getenv(variable);
  return (value != NULL && *value != '\0') ? atoi(value) : fallback;
}

static void *find_symbol(const char *variable, const char *fallback, const char *name) {
  const char *path = getenv(variable);
  if (path == NULL || *path == '\0') path = fallback;
  void *handle = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  void *symbol = handle ? dlsym(handle, name) : NULL;
  if (symbol == NULL) {
    fprintf(stderr,
            "sgemm_router: %s from %s is unavailable (%s); using the next BLAS instead. "
            "Set %s or rerun scripts/setup.\n",
            name, path, dlerror(), variable);
  }
  return symbol;
}

static void load_libraries(void) {
  sgemm_fn next_sgemm = (sgemm_fn)dlsym(RTLD_NEXT, "cblas_sgemm");
  dgemm_fn next_dgemm = (dgemm_fn)dlsym(RTLD_NEXT, "cblas_dgemm");
  single_row_sgemm =
      (sgemm_fn)find_symbol("MLX_REDRAFTER_SINGLE_ROW_BLAS", SINGLE_ROW_BLAS, "cblas_sgemm");
  multi_row_sgemm =
      (sgemm_fn)find_symbol("MLX_REDRAFTER_MULTI_ROW_BLAS", MULTI_ROW_BLAS, "scipy_cblas_sgemm");
  multi_row_dgemm =
      (dgemm_fn)find_symbol("MLX_REDRAFTER_MULTI_ROW_BLAS", MULTI_ROW_BLAS, "scipy_cblas_dgemm");
  if (single_row_sgemm == NULL) single_row_sgemm = next_sgemm;
  if (multi_row_sgemm == NULL) multi_row_sgemm = next_sgemm;
  if (multi_row_dgemm == NULL) multi_row_dgemm = next_dgemm;
  if (skinny_sgemm_available()) {
    skinny_max_rows = setting("MLX_REDRAFTER_SKINNY_ROWS", 16);
    long cpus = sysconf(_SC_NPROCESSORS_ONLN);
    int threads = setting("OPENBLAS_NUM_THREADS", cpus > 0 ? (int)cpus : 1);
    skinny_sgemm_configure(setting("MLX_REDRAFTER_SGEMM_THREADS", threads),
                           setting("MLX_REDRAFTER_SGEMM_SPIN", -1));
  }
  if (single_row_sgemm == NULL || multi_row_sgemm == NULL || multi_row_dgemm == NULL) {
    fprintf(stderr, "sgemm_router: no cblas_sgemm/cblas_dgemm to call at all\n");
    abort();
  }
}

void cblas_sgemm(int order, int transpose_a, int transpose_b, blas_int m, blas_int n, blas_int k,
                 float alpha, const float *a, blas_int lda, const float *b, blas_int ldb,
                 float beta, float *c, blas_int ldc) {
  pthread_once(&loaded, load_libraries);
  /* X (m, k) @ W (n, k)^T, row-major, with few rows: stream W once. */
  if (order == 101 && transpose_a == 111 && transpose_b == 112 && m >= 1 && m <= skinny_max_rows) {
    skinny_sgemm(m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
    return;
  }
  /* One row (row-major) or one column (column-major) of output: a vector product. */
  int vector = (order == 101) ? (m == 1) : (n == 1);
  (vector ? single_row_sgemm : multi_row_sgemm)(order, transpose_a, transpose_b, m, n, k, alpha, a,
                                                lda, b, ldb, beta, c, ldc);
}

void cblas_dgemm(int order, int transpose_a, int transpose_b, blas_int m, blas_int n, blas_int k,
                 double alpha, const double *a, blas_int lda, const double *b, blas_int ldb,
                 double beta, double *c, blas_int ldc) {
  pthread_once(&loaded, load_libraries);
  multi_row_dgemm(order, transpose_a, transpose_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}
