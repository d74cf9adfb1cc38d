/* skinny_sgemm.c: fp32 products of a few rows with a transposed weight matrix. */
#ifndef SKINNY_SGEMM_H
#define SKINNY_SGEMM_H

/* 1 if this CPU has a vector unit the kernel supports (selects the best); 0 otherwise. */
int skinny_sgemm_available(void);

/* Select a vector unit by name (tests run both where the CPU has both); 1 if this CPU
 * has it, 0 (and no change) if not. */
enum { SKINNY_BEST = 0, SKINNY_AVX2 = 1, SKINNY_AVX512 = 2 };
int skinny_sgemm_select(int isa);

/* Threads per product (1 = the calling thread only) and busy-wait iterations of an
 * idle helper thread before it sleeps (negative: keep the current value). */
void skinny_sgemm_configure(int threads, int spins);

/* The current number of threads per product. */
int skinny_sgemm_threads(void);

/* C (m, n) = alpha * X (m, k) @ W (n, k)^T + beta * C, all row-major with leading
 * dimensions ldx, ldw, ldc; C is not read when beta == 0. */
void skinny_sgemm(int m, int n, int k, float alpha, const float *x, int ldx, const float *w,
                  int ldw, float beta, float *c, int ldc);

#endif
