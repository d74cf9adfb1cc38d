/*
 * skinny_sgemm: C = alpha * X @ W^T + beta * C for a few rows of X (row-major), the
 * shape of every linear layer while decoding: X is (M, K) with M = 1..16 tokens,
 * W is an (N, K) weight matrix, C is (M, N).
 *
 * Such a product is bound by reading W from memory. General BLAS kernels pack and
 * block for large M and, on the benchmark machine, spend 1.3-3x the time of one pass
 * over W (docs/performance.md). This kernel streams W once: it takes a block of NB
 * rows of W, keeps them in L1 while every block of MB rows of X is multiplied with
 * them (M is cut into blocks of 4, 2, 1), and splits W's rows across threads.
 *
 * Every output element is one dot product computed the same way wherever it falls
 * (same vector width, same order of fused multiply-adds over k, same final
 * reduction), so a row of C has the same bits whatever M is and whichever thread
 * or block computed it: verifying N tokens at once gives each token exactly the
 * products it gets when decoded alone.
 *
 * Built into the sgemm router (sgemm_router.c); `skinny_sgemm_available()` says
 * whether this CPU has a supported vector unit (AVX-512F, or AVX2 with FMA).
 */
#define _GNU_SOURCE
#include <immintrin.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <unistd.h>

#include "skinny_sgemm.h"

typedef struct {
  int m, n, k;
  float alpha, beta;
  const float *x, *w;
  float *c;
  int ldx, ldw, ldc;
} product_t;

static inline float combine(const product_t *p, float dot, const float *old) {
  return p->beta == 0.0f ? p->alpha * dot : p->alpha * dot + p->beta * *old;
}

/* Point w at rows n..n+NB-1 of W (the last row repeated past the end of W) and x at
 * rows m..m+MB-1 of X; return the first row of the next block of W, which is fetched
 * into cache while this block computes. */
static inline __attribute__((always_inline)) const float *block_rows(
    const product_t *p, int n, int m, const int MB, const int NB, const float **w,
    const float **x) {
  for (int b = 0; b < NB; b++) w[b] = p->w + (size_t)(n + b < p->n ? n + b : n) * p->ldw;
  for (int a = 0; a < MB; a++) x[a] = p->x + (size_t)(m + a) * p->ldx;
  return p->w + (size_t)(n + NB < p->n ? n + NB : n) * p->ldw;
}

/* ---- AVX-512F: 16 lanes, 32 registers; tails of k through masked loads ---- */

__attribute__((target("avx512f"), always_inline)) static inline void block_avx512(
    const product_t *p, int n, int m, const int MB, const int NB) {
  const float *w[4], *x[4];
  const float *next = block_rows(p, n, m, MB, NB, w, x);
  __m512 acc[4][4];
  for (int a = 0; a < MB; a++)
    for (int b = 0; b < NB; b++) acc[a][b] = _mm512_setzero_ps();
  int kk = 0;
  for (; kk + 16 <= p->k; kk += 16) {
    for (int b = 0; b < NB; b++) _mm_prefetch((const char *)(next + b * p->ldw + kk), _MM_HINT_T0);
    __m512 wv[4];
    for (int b = 0; b < NB; b++) wv[b] = _mm512_loadu_ps(w[b] + kk);
    for (int a = 0; a < MB; a++) {
      __m512 xv = _mm512_loadu_ps(x[a] + kk);
      for (int b = 0; b < NB; b++) acc[a][b] = _mm512_fmadd_ps(xv, wv[b], acc[a][b]);
    }
  }
  if (kk < p->k) {
    __mmask16 tail = (__mmask16)((1u << (p->k - kk)) - 1u);
    __m512 wv[4];
    for (int b = 0; b < NB; b++) wv[b] = _mm512_maskz_loadu_ps(tail, w[b] + kk);
    for (int a = 0; a < MB; a++) {
      __m512 xv = _mm512_maskz_loadu_ps(tail, x[a] + kk);
      for (int b = 0; b < NB; b++) acc[a][b] = _mm512_fmadd_ps(xv, wv[b], acc[a][b]);
    }
  }
  for (int a = 0; a < MB; a++) {
    float *out = p->c + (size_t)(m + a) * p->ldc + n;
    for (int b = 0; b < NB && n + b < p->n; b++)
      out[b] = combine(p, _mm512_reduce_add_ps(acc[a][b]), out + b);
  }
}

__attribute__((target("avx512f"))) static void rows_avx512(const product_t *p, int n0, int n1) {
  for (int n = n0; n < n1; n += 4) {
    int m = 0;
    /* 4 x 4 (16 accumulators) up to four rows at a time, then 2 x 4 and 1 x 4; W's
     * four rows stay in L1 across the passes. (An 8 x 3 block for eight rows at a
     * time was twice as slow at M = 8.) */
    for (; m + 4 <= p->m; m += 4) block_avx512(p, n, m, 4, 4);
    if (m + 2 <= p->m) block_avx512(p, n, m, 2, 4), m += 2;
    if (m < p->m) block_avx512(p, n, m, 1, 4);
  }
}

/* ---- AVX2 + FMA: 8 lanes, 16 registers; scalar tail of k ---- */

__attribute__((target("avx2,fma"))) static inline float sum_avx2(__m256 v) {
  __m128 low = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  low = _mm_add_ps(low, _mm_movehl_ps(low, low));
  low = _mm_add_ss(low, _mm_movehdup_ps(low));
  return _mm_cvtss_f32(low);
}

__attribute__((target("avx2,fma"), always_inline)) static inline void block_avx2(
    const product_t *p, int n, int m, const int MB, const int NB) {
  const float *w[4], *x[4];
  const float *next = block_rows(p, n, m, MB, NB, w, x);
  __m256 acc[4][4];
  for (int a = 0; a < MB; a++)
    for (int b = 0; b < NB; b++) acc[a][b] = _mm256_setzero_ps();
  int kk = 0;
  for (; kk + 8 <= p->k; kk += 8) {
    if (kk % 16 == 0) /* one prefetch per 64-byte line */
      for (int b = 0; b < NB; b++) _mm_prefetch((const char *)(next + b * p->ldw + kk), _MM_HINT_T0);
    __m256 wv[4];
    for (int b = 0; b < NB; b++) wv[b] = _mm256_loadu_ps(w[b] + kk);
    for (int a = 0; a < MB; a++) {
      __m256 xv = _mm256_loadu_ps(x[a] + kk);
      for (int b = 0; b < NB; b++) acc[a][b] = _mm256_fmadd_ps(xv, wv[b], acc[a][b]);
    }
  }
  for (int a = 0; a < MB; a++) {
    float *out = p->c + (size_t)(m + a) * p->ldc + n;
    for (int b = 0; b < NB && n + b < p->n; b++) {
      float dot = sum_avx2(acc[a][b]);
      for (int t = kk; t < p->k; t++) dot = __builtin_fmaf(x[a][t], w[b][t], dot);
      out[b] = combine(p, dot, out + b);
    }
  }
}

__attribute__((target("avx2,fma"))) static void rows_avx2(const product_t *p, int n0, int n1) {
  for (int n = n0; n < n1; n += 2) {
    int m = 0;
    /* 4 x 2 (8 accumulators) up to four rows at a time, then 2 x 2 and 1 x 2. */
    for (; m + 4 <= p->m; m += 4) block_avx2(p, n, m, 4, 2);
    if (m + 2 <= p->m) block_avx2(p, n, m, 2, 2), m += 2;
    if (m < p->m) block_avx2(p, n, m, 1, 2);
  }
}

/* ---- dispatch and a small thread pool ---- */

typedef void (*rows_fn)(const product_t *, int, int);
static rows_fn rows_kernel;
static int row_block; /* W rows per kernel step: slices start at multiples of it */

int skinny_sgemm_select(int isa) {
  __builtin_cpu_init();
  int avx512 = __builtin_cpu_supports("avx512f");
  int avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  if ((isa == SKINNY_BEST || isa == SKINNY_AVX512) && avx512) {
    rows_kernel = rows_avx512, row_block = 4;
  } else if ((isa == SKINNY_BEST || isa == SKINNY_AVX2) && avx2) {
    rows_kernel = rows_avx2, row_block = 2;
  } else {
    return 0; /* the previous choice stays */
  }
  return 1;
}

int skinny_sgemm_available(void) { return skinny_sgemm_select(SKINNY_BEST); }

/* Products smaller than this many weights run on the calling thread alone. */
#define THREADED_MIN_WEIGHTS (1 << 17)
#define MAX_THREADS 16

static int num_threads = 1, spin_iterations = 20000;
static pthread_mutex_t pool_busy = PTHREAD_MUTEX_INITIALIZER;
static pthread_mutex_t pool_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t pool_wake = PTHREAD_COND_INITIALIZER;
static atomic_uint generation;   /* bumped once per threaded product */
static atomic_int remaining;     /* helpers still working on it */
static atomic_int sleeping;      /* helpers blocked on pool_wake */
static const product_t *current; /* the product being shared out ... */
static int sharing;              /* ... among this many threads (caller included) */
static int helpers;              /* helper threads running (index 1..helpers) */
static unsigned first_generation[MAX_THREADS]; /* `generation` when helper i started */

static void slice(const product_t *p, int index, int parts, int *start, int *stop) {
  int blocks = (p->n + row_block - 1) / row_block;
  *start = (int)((long)blocks * index / parts) * row_block;
  *stop = (int)((long)blocks * (index + 1) / parts) * row_block;
  if (*stop > p->n) *stop = p->n;
}

static void *helper_main(void *argument) {
  int index = (int)(long)argument;
  unsigned seen = first_generation[index];
  for (;;) {
    unsigned now;
    for (int spins = 0; (now = atomic_load(&generation)) == seen; spins++) {
      if (spins < spin_iterations) {
        _mm_pause();
        continue;
      }
      pthread_mutex_lock(&pool_lock);
      atomic_fetch_add(&sleeping, 1);
      while (atomic_load(&generation) == seen) pthread_cond_wait(&pool_wake, &pool_lock);
      atomic_fetch_sub(&sleeping, 1);
      pthread_mutex_unlock(&pool_lock);
    }
    const product_t *p = current;
    int parts = sharing;
    /* A helper that slept through a product it had no part in may wake after the next
     * one began: read that one's product, never a mix of two. */
    if (atomic_load(&generation) != now) continue;
    seen = now;
    if (index >= parts) continue; /* fewer threads configured than running */
    int start, stop;
    slice(p, index, parts, &start, &stop);
    if (start < stop) rows_kernel(p, start, stop);
    atomic_fetch_sub(&remaining, 1);
  }
  return NULL;
}

static void forget_helpers(void) { helpers = 0; } /* a forked child has none */

/* Called with pool_busy held. Returns how many threads can share a product. */
static int start_helpers(int wanted) {
  static int registered;
  if (!registered) pthread_atfork(NULL, NULL, forget_helpers), registered = 1;
  while (helpers + 1 < wanted) {
    pthread_t thread;
    first_generation[helpers + 1] = atomic_load(&generation);
    if (pthread_create(&thread, NULL, helper_main, (void *)(long)(helpers + 1)) != 0) break;
    pthread_detach(thread);
    helpers++;
  }
  return helpers + 1 < wanted ? helpers + 1 : wanted;
}

void skinny_sgemm_configure(int threads, int spins) {
  num_threads = threads < 1 ? 1 : threads > MAX_THREADS ? MAX_THREADS : threads;
  if (spins >= 0) spin_iterations = spins;
}

int skinny_sgemm_threads(void) { return num_threads; }

void skinny_sgemm(int m, int n, int k, float alpha, const float *x, int ldx, const float *w,
                  int ldw, float beta, float *c, int ldc) {
  product_t p = {m, n, k, alpha, beta, x, w, c, ldx, ldw, ldc};
  if (m < 1 || n < 1) return;
  if (num_threads < 2 || (long)n * k < THREADED_MIN_WEIGHTS ||
      pthread_mutex_trylock(&pool_busy) != 0) {
    rows_kernel(&p, 0, n); /* small, single-threaded, or the pool is in use */
    return;
  }
  sharing = start_helpers(num_threads);
  current = &p;
  atomic_store(&remaining, sharing - 1);
  atomic_fetch_add(&generation, 1);
  if (atomic_load(&sleeping) > 0) {
    pthread_mutex_lock(&pool_lock);
    pthread_cond_broadcast(&pool_wake);
    pthread_mutex_unlock(&pool_lock);
  }
  int start, stop;
  slice(&p, 0, sharing, &start, &stop);
  if (start < stop) rows_kernel(&p, start, stop);
  while (atomic_load(&remaining) > 0) _mm_pause();
  pthread_mutex_unlock(&pool_busy);
}
