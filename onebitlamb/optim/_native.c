/* 1-bit LAMB's stage-2 statistics in one pass (float32), loaded through ctypes by native.py.
 *
 * After the momentum all-reduce, 1-bit LAMB needs per element the Adam direction, the fresh
 * variance and how far the frozen denominator overstates the live one, and per layer a norm and a
 * maximum: in torch that is seven passes over memory and a Python call per layer for each
 * reduction, which made its compression-stage step slower than LAMB's on a fast network. Here it
 * is one pass: AVX2 or SSE2 intrinsics on x86-64, chosen at run time, plain C elsewhere. No
 * Python headers: any gcc builds it.
 */
#include <math.h>
#include <stdint.h>
#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define OBL_X86 1
#endif

/* For each layer l, the elements [offsets[l], offsets[l + 1]):
 *   g = m - beta1 * m_prev                  (1 - beta1 times the averaged gradient)
 *   v = beta2 * v + weight * g * g          (the fresh variance, in place; weight holds 1/(1-beta1)^2)
 *   update = m * inv_den * inv_bc1          (Adam's direction with the frozen denominator)
 *   min_quotient[l] = min((sqrt(v) + shift) * inv_den)   (its inverse is the largest den / sqrt(v))
 *   update_sumsq[l] = sum update^2          (the layer's norm, in double)
 * Every version below sums element k of a layer into double lane k mod 8 and adds the lanes in the
 * same order, and IEEE sqrt, mul and add round alike in each: the AVX2, SSE2 and scalar versions
 * give the same bits, so ranks on different machines cannot drift apart. */
typedef struct {
    float beta1, beta2, weight, shift, inv_bc1;
} params_t;

static inline void scalar_element(float *v, const float *m, const float *m_prev, const float *inv_den,
                                  float *update, int64_t i, const params_t *p, float *lo, double *sq) {
    float g = m[i] - p->beta1 * m_prev[i];
    float vi = p->beta2 * v[i] + p->weight * (g * g);
    v[i] = vi;
    float q = (sqrtf(vi) + p->shift) * inv_den[i];
    *lo = q < *lo ? q : *lo; /* the semantics of the SIMD minimum (a NaN quotient is skipped) */
    float u = m[i] * inv_den[i] * p->inv_bc1;
    update[i] = u;
    *sq += (double)u * u;
}

/* Elements [i, end) of the layer that starts at begin, into the lanes lo / sq (element k of the
 * layer goes to lane k mod 8), then the lanes reduced in a fixed order: returns the layer's
 * minimum quotient and writes its sum of squares. The vector versions call it for their tails. */
static float finish(float *v, const float *m, const float *m_prev, const float *inv_den, float *update,
                    int64_t i, int64_t end, int64_t begin, const params_t *p, float *lo, double *sq,
                    double *sumsq) {
    for (; i < end; i++)
        scalar_element(v, m, m_prev, inv_den, update, i, p, &lo[(i - begin) & 7], &sq[(i - begin) & 7]);
    float least = lo[0];
    double total = 0.0;
    for (int j = 0; j < 8; j++) {
        least = lo[j] < least ? lo[j] : least;
        total += sq[j];
    }
    *sumsq = total;
    return least;
}

static float layer_scalar(float *v, const float *m, const float *m_prev, const float *inv_den, float *update,
                          int64_t begin, int64_t end, const params_t *p, double *sumsq) {
    float lo[8];
    double sq[8];
    for (int j = 0; j < 8; j++) {
        lo[j] = INFINITY;
        sq[j] = 0.0;
    }
    return finish(v, m, m_prev, inv_den, update, begin, end, begin, p, lo, sq, sumsq);
}

#ifdef OBL_X86
static float layer_sse2(float *v, const float *m, const float *m_prev, const float *inv_den, float *update,
                        int64_t begin, int64_t end, const params_t *p, double *sumsq) {
    const __m128 b1 = _mm_set1_ps(p->beta1), b2 = _mm_set1_ps(p->beta2), w = _mm_set1_ps(p->weight);
    const __m128 shift = _mm_set1_ps(p->shift), ibc = _mm_set1_ps(p->inv_bc1);
    __m128 lo[2] = {_mm_set1_ps(INFINITY), _mm_set1_ps(INFINITY)};
    __m128d sq[4] = {_mm_setzero_pd(), _mm_setzero_pd(), _mm_setzero_pd(), _mm_setzero_pd()};
    int64_t i = begin;
    for (; i + 8 <= end; i += 8) {
        for (int h = 0; h < 2; h++) {
            int64_t k = i + 4 * h;
            __m128 mk = _mm_loadu_ps(m + k), d = _mm_loadu_ps(inv_den + k);
            __m128 g = _mm_sub_ps(mk, _mm_mul_ps(b1, _mm_loadu_ps(m_prev + k)));
            __m128 vk = _mm_add_ps(_mm_mul_ps(b2, _mm_loadu_ps(v + k)), _mm_mul_ps(w, _mm_mul_ps(g, g)));
            _mm_storeu_ps(v + k, vk);
            __m128 q = _mm_mul_ps(_mm_add_ps(_mm_sqrt_ps(vk), shift), d);
            lo[h] = _mm_min_ps(q, lo[h]);
            __m128 u = _mm_mul_ps(_mm_mul_ps(mk, d), ibc);
            _mm_storeu_ps(update + k, u);
            __m128d u01 = _mm_cvtps_pd(u), u23 = _mm_cvtps_pd(_mm_movehl_ps(u, u));
            sq[2 * h] = _mm_add_pd(sq[2 * h], _mm_mul_pd(u01, u01));
            sq[2 * h + 1] = _mm_add_pd(sq[2 * h + 1], _mm_mul_pd(u23, u23));
        }
    }
    float lo_lanes[8];
    double sq_lanes[8];
    _mm_storeu_ps(lo_lanes, lo[0]);
    _mm_storeu_ps(lo_lanes + 4, lo[1]);
    for (int h = 0; h < 4; h++) _mm_storeu_pd(sq_lanes + 2 * h, sq[h]);
    return finish(v, m, m_prev, inv_den, update, i, end, begin, p, lo_lanes, sq_lanes, sumsq);
}

__attribute__((target("avx2")))
static float layer_avx2(float *v, const float *m, const float *m_prev, const float *inv_den, float *update,
                        int64_t begin, int64_t end, const params_t *p, double *sumsq) {
    const __m256 b1 = _mm256_set1_ps(p->beta1), b2 = _mm256_set1_ps(p->beta2), w = _mm256_set1_ps(p->weight);
    const __m256 shift = _mm256_set1_ps(p->shift), ibc = _mm256_set1_ps(p->inv_bc1);
    __m256 lo = _mm256_set1_ps(INFINITY);
    __m256d sq_lo = _mm256_setzero_pd(), sq_hi = _mm256_setzero_pd();
    int64_t i = begin;
    for (; i + 8 <= end; i += 8) {
        __m256 mk = _mm256_loadu_ps(m + i), d = _mm256_loadu_ps(inv_den + i);
        __m256 g = _mm256_sub_ps(mk, _mm256_mul_ps(b1, _mm256_loadu_ps(m_prev + i)));
        __m256 vk = _mm256_add_ps(_mm256_mul_ps(b2, _mm256_loadu_ps(v + i)), _mm256_mul_ps(w, _mm256_mul_ps(g, g)));
        _mm256_storeu_ps(v + i, vk);
        __m256 q = _mm256_mul_ps(_mm256_add_ps(_mm256_sqrt_ps(vk), shift), d);
        lo = _mm256_min_ps(q, lo);
        __m256 u = _mm256_mul_ps(_mm256_mul_ps(mk, d), ibc);
        _mm256_storeu_ps(update + i, u);
        __m256d u0 = _mm256_cvtps_pd(_mm256_castps256_ps128(u)), u1 = _mm256_cvtps_pd(_mm256_extractf128_ps(u, 1));
        sq_lo = _mm256_add_pd(sq_lo, _mm256_mul_pd(u0, u0));
        sq_hi = _mm256_add_pd(sq_hi, _mm256_mul_pd(u1, u1));
    }
    float lo_lanes[8];
    double sq_lanes[8];
    _mm256_storeu_ps(lo_lanes, lo);
    _mm256_storeu_pd(sq_lanes, sq_lo);
    _mm256_storeu_pd(sq_lanes + 4, sq_hi);
    return finish(v, m, m_prev, inv_den, update, i, end, begin, p, lo_lanes, sq_lanes, sumsq);
}
#endif

typedef float (*layer_fn)(float *, const float *, const float *, const float *, float *, int64_t, int64_t,
                          const params_t *, double *);

/* isa: 0 picks the best this CPU has; 1 forces the scalar loop, 2 SSE2, 3 AVX2 (the tests compare
 * them). Returns the ISA used, or -1 if the one asked for is not available here. */
int obl_fresh_variance_stats(float *v, const float *m, const float *m_prev, const float *inv_den,
                             float *update, const int64_t *offsets, int64_t layers, float beta1, float beta2,
                             float weight, float shift, float inv_bc1, float *min_quotient,
                             double *update_sumsq, int isa) {
    const params_t p = {beta1, beta2, weight, shift, inv_bc1};
    int have = 1;
    layer_fn fns[4] = {0, layer_scalar, 0, 0};
#ifdef OBL_X86
    fns[2] = layer_sse2;
    have = 2;
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2")) {
        fns[3] = layer_avx2;
        have = 3;
    }
#endif
    if (isa == 0) isa = have;
    if (isa < 1 || isa > 3 || !fns[isa]) return -1;
    for (int64_t l = 0; l < layers; l++)
        min_quotient[l] = fns[isa](v, m, m_prev, inv_den, update, offsets[l], offsets[l + 1], &p, &update_sumsq[l]);
    return isa;
}
