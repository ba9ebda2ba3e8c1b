/* CSC's accumulate-and-score, fused into one pass, for CPU fp32 tensors.
 *
 * Why: under CSC a fresh gradient g is added into the residual v (v += g, a pass over the whole pool)
 * and then every chunk of v is scored by its L1 norm (a second pass: on ResNet-50's 100 MB pool
 * ~19 ms of a 2-rank step on 2 cores, docs/networks.md).  The second pass re-reads from memory what
 * the first has just written.  Here the score of each chunk is summed while v is written, so the
 * score costs no memory traffic of its own.
 *
 * v[j] + g[j] is the one fp32 add torch's add_ does (compiled with -ffp-contract=off): v holds the
 * same bits as on the torch path.  The scores are the same L1 norms summed in another order (16
 * lanes, then across the pieces of a chunk that different parameters hold), which is all CSC needs:
 * ranks agree on the scores because they allreduce them, not because each sums alike.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__F16C__) && defined(__AVX__)
#include <immintrin.h>
#define GF_F16C 1 /* gcc 12 does not vectorise _Float16 casts: 8 at a time by hand */
#endif

/* v[j] += g[j] for j < n, where v[0] sits at element `offset` of a pool cut into chunks of `chunk`
 * elements; scores[c] += sum of |v| over the elements of chunk c this call wrote (scores[0] is the
 * pool's first chunk). */
void gf_add_l1(float *v, const float *g, int64_t n, int64_t offset, int64_t chunk, float *scores) {
    int64_t j = 0;
    while (j < n) {
        const int64_t c = (offset + j) / chunk;
        int64_t end = (c + 1) * chunk - offset;
        if (end > n) end = n;
        float acc[16] = {0};
        int64_t k = j;
        for (; k + 16 <= end; k += 16)
            for (int i = 0; i < 16; i++) {
                const float x = v[k + i] + g[k + i];
                v[k + i] = x;
                acc[i] += fabsf(x);
            }
        float s = 0.0f;
        for (; k < end; k++) {
            const float x = v[k] + g[k];
            v[k] = x;
            s += fabsf(x);
        }
        for (int i = 0; i < 16; i++) s += acc[i];
        scores[c] += s;
        j = end;
    }
}

/* The selected chunks onto an fp16 wire and back: CSC's pack (gather, pre-divide, cast) and unpack
 * (cast, scatter, finite check), each one pass over the selected rows where the torch ops take three
 * (index_select, mul_, copy_; copy_, index_copy_, sum).  The same roundings as those ops: the product
 * x * scale rounded to fp32, then to fp16 (round to nearest even, as c10::Half); fp16 -> fp32 is exact. */

/* out[j*chunk + i] = half(src[idx[j]*chunk + i] * scale) for the m selected rows (idx ascending or not). */
void gf_pack_rows_f16(const float *src, int64_t chunk, const int64_t *idx, int64_t m, float scale, _Float16 *out) {
    for (int64_t j = 0; j < m; j++) {
        const float *row = src + idx[j] * chunk;
        _Float16 *o = out + j * chunk;
        int64_t i = 0;
#ifdef GF_F16C
        const __m256 s = _mm256_set1_ps(scale);
        for (; i + 8 <= chunk; i += 8) {
            const __m256 x = _mm256_mul_ps(_mm256_loadu_ps(row + i), s);
            _mm_storeu_si128((__m128i *)(o + i), _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT));
        }
#endif
        for (; i < chunk; i++) o[i] = (_Float16)(row[i] * scale);
    }
}

/* dst[idx[j]*chunk + i] = float(wire[j*chunk + i]); returns 1 if any value is inf or NaN (an fp16 sum
 * that overflowed), else 0. */
int gf_unpack_rows_f16(float *dst, int64_t chunk, const int64_t *idx, int64_t m, const _Float16 *wire) {
    int bad = 0;
    for (int64_t j = 0; j < m; j++) {
        float *row = dst + idx[j] * chunk;
        const _Float16 *w = wire + j * chunk;
        int64_t i = 0;
#ifdef GF_F16C
        const __m256 top = _mm256_set1_ps(65504.0f), sign = _mm256_set1_ps(-0.0f);
        __m256 ok = _mm256_castsi256_ps(_mm256_set1_epi32(-1));
        for (; i + 8 <= chunk; i += 8) {
            const __m256 x = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(w + i)));
            _mm256_storeu_ps(row + i, x);
            /* |x| <= 65504, false for inf and NaN (ordered, quiet compare) */
            ok = _mm256_and_ps(ok, _mm256_cmp_ps(_mm256_andnot_ps(sign, x), top, _CMP_LE_OQ));
        }
        bad |= _mm256_movemask_ps(ok) != 0xFF;
#endif
        for (; i < chunk; i++) {
            const float x = (float)w[i];
            row[i] = x;
            bad |= !(fabsf(x) <= 65504.0f); /* inf, or NaN (every comparison with it is false) */
        }
    }
    return bad;
}

/* Rows idx[j] of a [*, chunk] fp32 buffer set to +0.0 (all-zero bits: one memset per row).  CSC's
 * clear of last step's chunks in the pool and its masking of the sent chunks in v and u: torch's
 * index_fill_ computes an address per element and took twice as long (~1 ms per 10 MB). */
void gf_zero_rows(float *dst, int64_t chunk, const int64_t *idx, int64_t m) {
    for (int64_t j = 0; j < m; j++) memset(dst + idx[j] * chunk, 0, (size_t)chunk * sizeof(float));
}
