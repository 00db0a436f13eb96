/* Fused CPU loops of the 1-bit codec (float32), loaded through ctypes by native.py.
 *
 * numpy runs each step of the compressor as its own pass with a Python call per cache-sized
 * slice; here each loop does its steps in one pass over memory. Conventions as in packing.py:
 * bit 1 = negative, most significant bit first, sign(0) = sign(-0.0) = +1 (x < 0 is false),
 * NaN packs as +1. Plain C, no Python headers: any gcc builds it.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

/* REVERSED[b] is b with its 8 bits in the opposite order: movemask yields element 0 in the least
 * significant bit, the packed format wants it in the most significant. */
static uint8_t REVERSED[256];
static int reversed_ready = 0;

static void init_reversed(void) {
    if (reversed_ready) return;
    for (int b = 0; b < 256; b++) {
        uint8_t r = 0;
        for (int j = 0; j < 8; j++) r |= (uint8_t)(((b >> j) & 1) << (7 - j));
        REVERSED[b] = r;
    }
    reversed_ready = 1;
}

/* e += b (when b is not NULL); returns the sum of squares of the new e. Eight double
 * accumulators, one per lane: exact enough to match a float64 sum, and independent chains that
 * the compiler can vectorise without reassociating (no -ffast-math). n is a multiple of 8. */
double obl_add_sumsq(float *e, const float *b, int64_t n) {
    double lanes[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    if (b) {
        for (int64_t i = 0; i < n; i += 8) {
            for (int j = 0; j < 8; j++) {
                float y = e[i + j] + b[i + j];
                e[i + j] = y;
                lanes[j] += (double)y * y;
            }
        }
    } else {
        for (int64_t i = 0; i < n; i += 8)
            for (int j = 0; j < 8; j++) lanes[j] += (double)e[i + j] * e[i + j];
    }
    double total = 0.0;
    for (int j = 0; j < 8; j++) total += lanes[j];
    return total;
}

/* Pack the signs of e into out (n a multiple of 8) and subtract s * sign(e) from e. */
void obl_sign_pack_update(float *e, uint8_t *out, int64_t n, float s) {
    init_reversed();
#if defined(__SSE2__)
    const __m128 zero = _mm_setzero_ps(), scale = _mm_set1_ps(s), sign = _mm_set1_ps(-0.0f);
    for (int64_t k = 0; k < n / 8; k++) {
        float *y = e + 8 * k;
        __m128 lo = _mm_loadu_ps(y), hi = _mm_loadu_ps(y + 4);
        __m128 neg_lo = _mm_cmplt_ps(lo, zero), neg_hi = _mm_cmplt_ps(hi, zero);  /* false for -0.0, NaN */
        out[k] = REVERSED[_mm_movemask_ps(neg_lo) | (_mm_movemask_ps(neg_hi) << 4)];
        /* y - (+s) where non-negative, y - (-s) where negative: the sign bit of s flipped by the mask */
        _mm_storeu_ps(y, _mm_sub_ps(lo, _mm_xor_ps(scale, _mm_and_ps(neg_lo, sign))));
        _mm_storeu_ps(y + 4, _mm_sub_ps(hi, _mm_xor_ps(scale, _mm_and_ps(neg_hi, sign))));
    }
#else
    for (int64_t k = 0; k < n / 8; k++) {
        float *y = e + 8 * k;
        uint8_t byte = 0;
        for (int j = 0; j < 8; j++) {
            int negative = y[j] < 0.0f;
            byte |= (uint8_t)(negative << (7 - j));
            y[j] -= negative ? -s : s;
        }
        out[k] = byte;
    }
#endif
}

/* The 256 x 8 table of s * (+-1) that a byte of signs selects a row of. */
static void fill_table(float *table, float s) {
    for (int b = 0; b < 256; b++)
        for (int j = 0; j < 8; j++) table[8 * b + j] = (b >> (7 - j)) & 1 ? -s : s;
}

/* out[8k + j] = -s where bit j of packed[k] is set, else +s: one 32-byte row copy per byte. */
void obl_expand(const uint8_t *packed, int64_t nbytes, float s, float *out) {
    float table[256 * 8];
    fill_table(table, s);
    for (int64_t k = 0; k < nbytes; k++) memcpy(out + 8 * k, table + 8 * packed[k], 8 * sizeof(float));
}

/* target[8k + j] += sum over ranks r of (bit j of rows[r * stride + k] ? -scales[r] : scales[r]),
 * the server's sum: each rank's byte selects a row of its own table, the rows are added to the
 * target's 8 values in registers, which are written once; returns the sum of squares of the new
 * target (the server compressor's norm), in double lanes. */
double obl_add_signs_sumsq(float *target, const uint8_t *rows, int64_t stride, int64_t ranks,
                           int64_t nbytes, const float *scales) {
    float *tables = malloc((size_t)ranks * 256 * 8 * sizeof(float));
    if (!tables) return -1.0; /* the caller treats a negative sum of squares as failure */
    for (int64_t r = 0; r < ranks; r++) fill_table(tables + r * 256 * 8, scales[r]);
    double lanes[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int64_t k = 0; k < nbytes; k++) {
        float acc[8];
        memcpy(acc, target + 8 * k, sizeof acc);
        for (int64_t r = 0; r < ranks; r++) {
            const float *add = tables + r * 256 * 8 + 8 * rows[r * stride + k];
            for (int j = 0; j < 8; j++) acc[j] += add[j];
        }
        memcpy(target + 8 * k, acc, sizeof acc);
        for (int j = 0; j < 8; j++) lanes[j] += (double)acc[j] * acc[j];
    }
    free(tables);
    double total = 0.0;
    for (int j = 0; j < 8; j++) total += lanes[j];
    return total;
}
