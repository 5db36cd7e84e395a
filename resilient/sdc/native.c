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

/* ---- the checksummed GEMMs of a Linear layer (abft.py): each operand read once ----
 *
 * The identities' sides in float32, as the torch path computes them (abft.py's bound
 * charges the check's own float32 arithmetic for any summation order), in one pass per
 * operand: the torch path takes an |.| copy of each operand and one kernel per quantity,
 * each one more pass and one more dispatch per Linear and GEMM. */

/* W [n, k]: its row sums and |.| row sums [n], and column sums and |.| column sums [k]. */
void rs_gemm_weight(const float *w, int64_t n, int64_t k, float *rows, float *abs_rows, float *cols,
                    float *abs_cols) {
    memset(cols, 0, (size_t)k * sizeof *cols);
    memset(abs_cols, 0, (size_t)k * sizeof *abs_cols);
    for (int64_t r = 0; r < n; r++) {
        const float *x = w + r * k;
        float s = 0.0f, a = 0.0f;
#pragma omp simd reduction(+:s, a)
        for (int64_t c = 0; c < k; c++) {
            float v = x[c], f = fabsf(v);
            s += v;
            a += f;
            cols[c] += v;
            abs_cols[c] += f;
        }
        rows[r] = s;
        abs_rows[r] = a;
    }
}

/* X [m, k] against v and va [k] (va ≥ 0): per row Σ x·v and Σ |x|·va [m]; with rows not
 * NULL, also the row sums and |.| row sums of X [m]. */
void rs_gemm_rows(const float *x, int64_t m, int64_t k, const float *v, const float *va, float *xv,
                  float *xva, float *rows, float *abs_rows) {
    for (int64_t r = 0; r < m; r++) {
        const float *p = x + r * k;
        float d = 0.0f, da = 0.0f, s = 0.0f, a = 0.0f;
#pragma omp simd reduction(+:d, da, s, a)
        for (int64_t c = 0; c < k; c++) {
            float e = p[c], f = fabsf(e);
            d += e * v[c];
            da += f * va[c];
            s += e;
            a += f;
        }
        xv[r] = d;
        xva[r] = da;
        if (rows) {
            rows[r] = s;
            abs_rows[r] = a;
        }
    }
}

/* dY [m, n]: per row Σ dy·wr and Σ |dy|·war [m] (the grad-input identity's side); with xr
 * not NULL, Σ_row dy·xr[row] and Σ_row |dy|·xar[row] [n] *added* to cols and abs_cols (the
 * grad-weight identity's side, summed over a weight's uses in one backward). */
void rs_gemm_dy(const float *d, int64_t m, int64_t n, const float *wr, const float *war, const float *xr,
                const float *xar, float *dx, float *abs_dx, float *cols, float *abs_cols) {
    for (int64_t r = 0; r < m; r++) {
        const float *p = d + r * n;
        float s = 0.0f, a = 0.0f;
        if (xr) {
            float xw = xr[r], xa = xar[r];
#pragma omp simd reduction(+:s, a)
            for (int64_t c = 0; c < n; c++) {
                float e = p[c], f = fabsf(e);
                s += e * wr[c];
                a += f * war[c];
                cols[c] += e * xw;
                abs_cols[c] += f * xa;
            }
        } else {
#pragma omp simd reduction(+:s, a)
            for (int64_t c = 0; c < n; c++) {
                float e = p[c];
                s += e * wr[c];
                a += fabsf(e) * war[c];
            }
        }
        dx[r] = s;
        abs_dx[r] = a;
    }
}

/* One GEMM's verdict: Y [rows, width] (its output) summed per row against the identity's
 * side expect [rows], within bound = scale·rel + floor. out = (worst |Δ|/bound, its |Δ|, its
 * bound, its row, harm·max|Y|), in float64: a row whose |Δ| + bound is not finite counts 0
 * (the nonfinite checks' case), the first worst row wins (torch's argmax), a NaN in Y makes
 * max|Y| NaN (torch's aminmax). */
void rs_gemm_record(const float *y, int64_t rows, int64_t width, const float *expect, const float *scale,
                    double rel, double floor, double harm, double *out) {
    double worst = -1.0, wdiff = 0.0, wbound = 0.0;
    int64_t wrow = 0;
    float amax = 0.0f;
    int nan = 0;
    for (int64_t r = 0; r < rows; r++) {
        const float *p = y + r * width;
        float s = 0.0f, m = 0.0f;
#pragma omp simd reduction(+:s) reduction(max:m)
        for (int64_t c = 0; c < width; c++) {
            float f = fabsf(p[c]);
            s += p[c];
            m = f > m ? f : m;
        }
        if (isnan(s))
            nan = 1;
        amax = m > amax ? m : amax;
        /* in float32, as torch's (got - expect).abs() and scale·rel + floor */
        float diff = fabsf(s - expect[r]), bound = (float)((double)scale[r] * rel + floor);
        double ratio = isfinite(diff + bound) ? (double)(diff / bound) : 0.0;
        if (ratio > worst) {
            worst = ratio;
            wdiff = diff;
            wbound = bound;
            wrow = r;
        }
    }
    out[0] = worst < 0.0 ? 0.0 : worst;
    out[1] = wdiff;
    out[2] = wbound;
    out[3] = (double)wrow;
    out[4] = nan ? (double)NAN : harm * (double)amax;
}
