/* One-pass checksum kernels for the SDC checks on CPU (see native.py).
 *
 * Each function reads its input once. The torch equivalents take one kernel
 * per quantity (a float64 sum, an L1, a bit-sum), each a separate pass over
 * memory that backward has just pushed out of the caches, plus one dispatch
 * per tensor; these fuse the quantities and take a whole list of tensors per
 * call.
 *
 * Exactness: bit-sums are sums of the raw 32-bit words modulo 2**32, the same
 * integers as torch's int32 sum of an int32 view in any order. Float64 sums
 * may be reordered by the vectoriser (omp simd reductions): every SDC bound
 * charges gamma_n(2**-53) for the float64 sums, valid for any order.
 * No global state, no allocation: callers own every buffer.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

/* Every loop keeps LANES independent partial sums (an array the compiler keeps
 * in vector registers) and folds them at the end: more loads in flight than
 * one vector accumulator allows, which is what a pass over memory that is no
 * longer in cache needs (measured ~15% faster than a single accumulator). */
#define LANES 16

static uint32_t words(const uint32_t *w, int64_t n) {
    uint32_t acc[LANES];
    memset(acc, 0, sizeof acc);
    int64_t m = n / LANES * LANES;
    for (int64_t i = 0; i < m; i += LANES) {
#pragma omp simd
        for (int j = 0; j < LANES; j++)
            acc[j] += w[i + j];
    }
    uint32_t b = 0;
    for (int j = 0; j < LANES; j++)
        b += acc[j];
    for (int64_t i = m; i < n; i++)
        b += w[i];
    return b;
}

/* Float64 sum, float64 L1, largest magnitude and 32-bit bit-sum of n float32. */
static void four(const float *x, int64_t n, double *sum, double *l1, float *amax, uint32_t *bits) {
    const uint32_t *w = (const uint32_t *)x;
    double s[LANES], a[LANES];
    float m[LANES];
    uint32_t b[LANES];
    memset(s, 0, sizeof s);
    memset(a, 0, sizeof a);
    memset(m, 0, sizeof m);
    memset(b, 0, sizeof b);
    int64_t e = n / LANES * LANES;
    for (int64_t i = 0; i < e; i += LANES) {
#pragma omp simd
        for (int j = 0; j < LANES; j++) {
            double v = (double)x[i + j];
            float f = fabsf(x[i + j]);
            s[j] += v;
            a[j] += fabs(v);
            m[j] = f > m[j] ? f : m[j];
            b[j] += w[i + j];
        }
    }
    double ts = 0.0, ta = 0.0;
    float tm = 0.0f;
    uint32_t tb = 0;
    for (int j = 0; j < LANES; j++) {
        ts += s[j];
        ta += a[j];
        tm = m[j] > tm ? m[j] : tm;
        tb += b[j];
    }
    for (int64_t i = e; i < n; i++) {
        float f = fabsf(x[i]);
        ts += (double)x[i];
        ta += (double)f;
        tm = f > tm ? f : tm;
        tb += w[i];
    }
    *sum = ts;
    *l1 = ta;
    *amax = tm;
    *bits = tb;
}

/* Per row of a contiguous [rows, cols] float32 matrix: the float64 sum and
 * the float64 sum of absolute values. The reduce-scatter input, one row per
 * destination rank. */
void rs_rows_sum_l1(const float *x, int64_t rows, int64_t cols, double *sum, double *l1) {
    float amax;
    uint32_t bits;
    for (int64_t r = 0; r < rows; r++)   /* amax and bits come free: the pass is bound by memory */
        four(x + r * cols, cols, &sum[r], &l1[r], &amax, &bits);
}

/* Float64 sum and 32-bit bit-sum of n contiguous float32: a collective's output. */
void rs_sum_bits(const float *x, int64_t n, double *sum, int64_t *bits) {
    double l1;
    float amax;
    uint32_t b;
    four(x, n, sum, &l1, &amax, &b);
    *bits = (int64_t)(int32_t)b;
}

/* Per segment of contiguous float32: float64 sum, float64 L1, largest
 * magnitude (NaN when an element is NaN, i.e. when the L1 is NaN: torch's
 * aminmax propagates it; +inf and -inf alone make the sum NaN, not this) and
 * the bit-sum, stored as int64 bytes in the fourth slot. out is [n_seg, 4]. */
void rs_stats(int64_t n_seg, const uint64_t *ptrs, const int64_t *lens, double *out) {
    for (int64_t k = 0; k < n_seg; k++) {
        double s, a;
        float m;
        uint32_t b;
        four((const float *)(uintptr_t)ptrs[k], lens[k], &s, &a, &m, &b);
        int64_t bits = (int64_t)(int32_t)b;
        out[4 * k] = s;
        out[4 * k + 1] = a;
        out[4 * k + 2] = isnan(a) ? (double)NAN : (double)m;
        memcpy(&out[4 * k + 3], &bits, sizeof bits);
    }
}

/* Bit-sums of n_seg segments of 32-bit words (pointers and lengths in words):
 * the at-rest records of parameters and optimizer state in one call. */
void rs_bitsums(int64_t n_seg, const uint64_t *ptrs, const int64_t *lens, int64_t *out) {
    for (int64_t k = 0; k < n_seg; k++)
        out[k] = (int64_t)(int32_t)words((const uint32_t *)(uintptr_t)ptrs[k], lens[k]);
}
