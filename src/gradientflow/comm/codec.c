/* The block quantiser of quantize.py, fused into one pass per block, for CPU tensors.
 *
 * Why: quantize() and dequantize() in torch ops walk a segment ~40 times (aminmax, divide, three
 * comparisons, Horner, copysign, pack, error, ...); on a CPU rank that had one core this cost more than
 * the wire it saved (~28 ns per gradient element per step).  Here every block of `block` elements
 * (<= 1024) is read once into L1, and codes, scale, decoded values and error are written in the same
 * pass.
 *
 * Bit-identical to the torch path: the same fp32 operations in the same order per element (divide by
 * the bf16-rounded scale, compare against the fp32 midpoints, Horner on the fp32 coefficients, copysign,
 * multiply), compiled with -ffp-contract=off so no multiply-add is fused.  tests/test_codec.py checks
 * both paths against each other byte for byte.
 *
 * Only the tabled levels (2, 3 bits: L = 1, 3 magnitudes above the first), no clipping; quantize.py keeps
 * the rest.  `first` is the first level (0 for the fitted tables with a zero, l_0 for the zeroless one):
 * added after Horner only where it is not 0, as quantize._level_of does (a literal `zeroless` at the call
 * sites, so the tables with a zero compile to the loop they had).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#ifdef __AVX2__
#include <immintrin.h>
#endif

/* fp32 -> bf16, round to nearest even, NaN kept quiet: c10::BFloat16's conversion. */
static inline uint16_t to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if (f != f) return 0x7FC0;
    u += 0x7FFF + ((u >> 16) & 1);
    return (uint16_t)(u >> 16);
}

static inline float from_bf16(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* l_k by Horner, as quantize._level_of: out = k*c[L-1]; out = (out + c[i]) * k for i = L-2..0. */
static inline float level_of(float k, int L, const float *c) {
    float out = k * c[L - 1];
    for (int i = L - 2; i >= 0; i--) out = (out + c[i]) * k;
    return out;
}

static inline void pack_block(const uint8_t *codes, int n, int bits, uint8_t *out) {
    /* 8 codes -> `bits` bytes, little-endian, code i at bit bits*i: the 8 code bytes read as one word and their
     * bits moved together in three merge steps (pairs, quads, the two halves) instead of 8 shifts and ors. */
    for (int g = 0; g < n; g += 8) {
        uint64_t w;
        memcpy(&w, codes + g, 8);
        w = (w & 0x00FF00FF00FF00FFull) | ((w & 0xFF00FF00FF00FF00ull) >> (8 - bits));
        w = (w & 0x0000FFFF0000FFFFull) | ((w & 0xFFFF0000FFFF0000ull) >> (16 - 2 * bits));
        w = (w & 0x00000000FFFFFFFFull) | ((w & 0xFFFFFFFF00000000ull) >> (32 - 4 * bits));
        for (int j = 0; j < bits; j++) *out++ = (uint8_t)(w >> (8 * j));
    }
}

/* One block of n (<= block) elements: L is a literal at both call sites, so the element loop has no
 * inner loop left and vectorises. */
static inline __attribute__((always_inline)) void encode_block(const float *x, int n, int block, int bits,
                                                                const int L, const float *mids,
                                                                const float *poly, const int zeroless,
                                                                const float first, uint8_t *codes_out,
                                                                uint16_t *scale_out, float *decoded,
                                                                float *err, int carry) {
    float v[1024], dec[1024];
    uint8_t codes[1024];
    if (carry)
        for (int i = 0; i < n; i++) v[i] = x[i] + err[i];
    else
        memcpy(v, x, (size_t)n * 4);
    for (int i = n; i < block; i++) v[i] = 0.0f;
    /* max |x| as the largest of the magnitudes' bit patterns (unsigned): the same order as the floats',
     * and any NaN's pattern is above inf's, so a NaN wins as in aminmax; +0 for a zero block, as
     * quantize.py.  An integer max, so the loop vectorises. */
    uint32_t top = 0;
    for (int i = 0; i < block; i++) {
        uint32_t u;
        memcpy(&u, &v[i], 4);
        u &= 0x7FFFFFFFu;
        top = u > top ? u : top;
    }
    float amax;
    memcpy(&amax, &top, 4);
    const uint16_t sb = to_bf16(amax);
    *scale_out = sb;
    const float step = from_bf16(sb);
    const float safe = step > 0.0f ? step : 1.0f;
    const uint8_t sign_code = (uint8_t)(1 << (bits - 1));
    for (int i = 0; i < block; i++) {
        const float u = v[i] / safe;
        const float a = fabsf(u);
        int k = a > mids[0];
        if (L > 1) k += (a > mids[1]) + (a > mids[2]);
        float mag = level_of((float)k, L, poly);
        if (zeroless) mag = mag + first;
        dec[i] = copysignf(mag, u) * step;
        codes[i] = (uint8_t)k | (signbit(u) ? sign_code : 0);
    }
    pack_block(codes, block, bits, codes_out);
    if (err)
        for (int i = 0; i < n; i++) err[i] = v[i] - dec[i];
    if (decoded) memcpy(decoded, dec, (size_t)n * 4);
}

#ifdef __AVX2__
/* encode_block for a whole block (n == block, a multiple of 8) in 8-wide vectors: the same fp32 operations per
 * element (x + err, divide by the scale, three ordered compares, the level, copysign, multiply, subtract), the
 * level looked up in a table of the L + 1 magnitudes computed by level_of itself (the same floats as evaluating it
 * per element: it is a function of k alone), and 8 codes shifted into one word and or-ed across the lanes.  No
 * copy of the block: a second read of x (and err) where the scalar loop keeps v; every write to x, err or decoded
 * at an element comes after that element's last read, so they may alias x as in encode_block. */
static inline __attribute__((always_inline)) void encode_block8(const float *x, int block, int bits, const int L,
                                                                 const float *mids, const float *mag_of,
                                                                 uint8_t *codes_out, uint16_t *scale_out,
                                                                 float *decoded, float *err, int carry) {
    const __m256i absmask = _mm256_set1_epi32(0x7FFFFFFF);
    __m256i top8 = _mm256_setzero_si256();
    for (int i = 0; i < block; i += 8) {
        __m256 v = _mm256_loadu_ps(x + i);
        if (carry) v = _mm256_add_ps(v, _mm256_loadu_ps(err + i));
        top8 = _mm256_max_epu32(top8, _mm256_and_si256(_mm256_castps_si256(v), absmask));
    }
    __m128i t = _mm_max_epu32(_mm256_castsi256_si128(top8), _mm256_extracti128_si256(top8, 1));
    t = _mm_max_epu32(t, _mm_shuffle_epi32(t, 0x4E));
    t = _mm_max_epu32(t, _mm_shuffle_epi32(t, 0xB1));
    const uint32_t top = (uint32_t)_mm_cvtsi128_si32(t);
    float amax;
    memcpy(&amax, &top, 4);
    const uint16_t sb = to_bf16(amax);
    *scale_out = sb;
    const float step = from_bf16(sb);
    const __m256 safe = _mm256_set1_ps(step > 0.0f ? step : 1.0f), stepv = _mm256_set1_ps(step);
    const __m256 sign = _mm256_castsi256_ps(_mm256_set1_epi32((int)0x80000000u));
    const __m256 m0 = _mm256_set1_ps(mids[0]), m1 = _mm256_set1_ps(L > 1 ? mids[1] : 0.0f);
    const __m256 m2 = _mm256_set1_ps(L > 1 ? mids[2] : 0.0f);
    const __m256 table = _mm256_loadu_ps(mag_of);
    const __m256i shifts = _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(bits));
    for (int i = 0; i < block; i += 8) {
        __m256 v = _mm256_loadu_ps(x + i);
        if (carry) v = _mm256_add_ps(v, _mm256_loadu_ps(err + i));
        const __m256 u = _mm256_div_ps(v, safe);
        const __m256 a = _mm256_andnot_ps(sign, u);
        /* a compare is all ones (-1) where true: k = -(sum of the compares) */
        __m256i k = _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_castps_si256(_mm256_cmp_ps(a, m0, _CMP_GT_OQ)));
        if (L > 1) {
            k = _mm256_sub_epi32(k, _mm256_castps_si256(_mm256_cmp_ps(a, m1, _CMP_GT_OQ)));
            k = _mm256_sub_epi32(k, _mm256_castps_si256(_mm256_cmp_ps(a, m2, _CMP_GT_OQ)));
        }
        const __m256 mag = _mm256_permutevar8x32_ps(table, k);
        const __m256 dec = _mm256_mul_ps(_mm256_or_ps(_mm256_andnot_ps(sign, mag), _mm256_and_ps(sign, u)), stepv);
        const __m256i code = _mm256_or_si256(
            k, _mm256_slli_epi32(_mm256_srli_epi32(_mm256_castps_si256(u), 31), bits - 1));
        const __m256i sh = _mm256_sllv_epi32(code, shifts);
        __m128i w = _mm_or_si128(_mm256_castsi256_si128(sh), _mm256_extracti128_si256(sh, 1));
        w = _mm_or_si128(w, _mm_shuffle_epi32(w, 0x4E));
        w = _mm_or_si128(w, _mm_shuffle_epi32(w, 0xB1));
        const uint32_t word = (uint32_t)_mm_cvtsi128_si32(w);
        for (int j = 0; j < bits; j++) codes_out[i / 8 * bits + j] = (uint8_t)(word >> (8 * j));
        if (err) _mm256_storeu_ps(err + i, _mm256_sub_ps(v, dec));
        if (decoded) _mm256_storeu_ps(decoded + i, dec);
    }
}
#endif

/* The preconditioner's passes (exchange/precondition.py), for CPU tensors: r = sqrt(q floored) is
 * computed where it is used instead of being written out, and the divide before the ring, the two
 * multiplies after it and the EMA of the squared result share one pass each (11 torch passes -> 2); in a
 * two-rank exchange they run inside gf_quantize's and gf_dequantize's own passes, block by block while the
 * block is in L1 (no pass of their own: 1.6 ns a gradient over 3 bits' codec instead of 2.5 on this
 * project's CPU, docs/results/adamw.md).
 * The floors come from torch (their means keep torch's summation order); per element these are the
 * torch path's fp32 operations in its order, so the results are bit-identical (tests/test_codec.py).
 * wf: one floor per window of `window` coordinates, coordinate i (offset + i in its bucket) in window
 * (offset + i) / window; bf: the bucket's floor; unit: r = 1 everywhere (no history yet). */
static inline float max_nan(float a, float b) { return (a != a || a > b) ? a : b; } /* torch.maximum */

/* The windows of a range: coordinate i (offset + i in its bucket) has floor max(wf[(offset + i) / window], bf),
 * the same as torch's max(max(q, wf), bf) (max is associative, and a NaN anywhere gives NaN either way).  The
 * inner loops have no division and no branch, so they vectorise (sqrtf too: -fno-math-errno). */
#define FOR_WINDOWS(n, offset, window, wf, bf, BODY)                                     \
    for (int64_t i0 = 0; i0 < (n);) {                                                   \
        const int64_t w = ((offset) + i0) / (window);                                   \
        const int64_t end = (w + 1) * (window) - (offset) < (n) ? (w + 1) * (window) - (offset) : (n); \
        const float fl = max_nan((wf)[w], (bf));                                        \
        for (int64_t i = i0; i < end; i++) { BODY }                                     \
        i0 = end;                                                                       \
    }

/* x = (x + e) / r */
void gf_precondition_in(float *x, const float *e, const float *q, const float *wf, float bf, int unit, int64_t n,
                        int64_t offset, int window) {
    if (unit) {
        for (int64_t i = 0; i < n; i++) x[i] = x[i] + e[i];
        return;
    }
    FOR_WINDOWS(n, offset, window, wf, bf, { x[i] = (x[i] + e[i]) / sqrtf(max_nan(q[i], fl)); })
}

/* q * beta + c * x * x as torch's mul_ then addcmul_: its AVX2 kernel computes fma(c * x, x, q * beta) (one
 * rounding for the multiply-add), its scalar build two roundings; __FMA__ is defined where native.flags()
 * found torch's AVX2 (-mfma beside -mavx2). */
static inline float ema_of(float q, float x, float beta, float c) {
#ifdef __FMA__
    return fmaf(c * x, x, q * beta);
#else
    return q * beta + c * x * x;
#endif
}

/* x *= r; e *= r; then (ema) q = ema_of(q, x) with the restored x (r from q before it). */
void gf_precondition_out(float *x, float *e, float *q, const float *wf, float bf, int unit, int64_t n, int64_t offset,
                         int window, int ema, float beta, float c) {
    if (unit) {  /* r = 1: x and e unchanged */
        if (ema)
            for (int64_t i = 0; i < n; i++) q[i] = ema_of(q[i], x[i], beta, c);
        return;
    }
    if (ema)
        FOR_WINDOWS(n, offset, window, wf, bf, {
            const float r = sqrtf(max_nan(q[i], fl));
            const float xi = x[i] * r;
            x[i] = xi;
            e[i] = e[i] * r;
            q[i] = ema_of(q[i], xi, beta, c);
        })
    else
        FOR_WINDOWS(n, offset, window, wf, bf, {
            const float r = sqrtf(max_nan(q[i], fl));
            x[i] = x[i] * r;
            e[i] = e[i] * r;
        })
}

/* Encode m elements of x (nb = ceil(m / block) blocks, the last padded with zeros) into codes
 * (nb * block * bits / 8 bytes) and scales (nb bf16).  decoded (m floats, may alias x) gets what every
 * receiver decodes (or NULL: not written, where the caller decodes the codes again); err (m floats, or NULL)
 * gets x - decoded.  carry (err given): x + err is encoded
 * instead (error feedback: err holds the last error on entry), one pass fewer than adding it first.
 * block: a multiple of 16, <= 1024.  pq (err given, or NULL): the preconditioner's q with its floors
 * (gf_precondition_in's arguments, x[0] at poffset): each block is first made (x + err) / r in place, just
 * before it is encoded, so the divide costs no pass of its own (carry is then implied). */
void gf_quantize(float *x, int64_t m, int bits, int block, const float *mids, const float *poly,
                 float first, uint8_t *codes_out, uint16_t *scales_out, float *decoded, float *err, int carry,
                 const float *pq, const float *pwf, float pbf, int punit, int64_t poffset, int pwindow) {
    const int64_t nb = (m + block - 1) / block;
#ifdef __AVX2__
    /* the magnitude of each code magnitude k, as encode_block computes it per element */
    float mag_of[8] = {0};
    const int L = bits == 3 ? 3 : 1;
    for (int k = 0; k <= L; k++) {
        mag_of[k] = level_of((float)k, L, poly);
        if (first != 0.0f) mag_of[k] = mag_of[k] + first;
    }
#endif
    for (int64_t b = 0; b < nb; b++) {
        const int64_t a0 = b * block;
        const int n = (int)(m - a0 < block ? m - a0 : block);
        if (pq) { /* x = (x + err) / r on this block, then encode it as it is (it is in L1 now) */
            gf_precondition_in(x + a0, err + a0, pq + a0, pwf, pbf, punit, n, poffset + a0, pwindow);
            carry = 0;
        }
        uint8_t *c = codes_out + a0 / 8 * bits;
        float *e = err ? err + a0 : NULL;
        float *d = decoded ? decoded + a0 : NULL;
#ifdef __AVX2__
        if (n == block) { /* every block but a segment's last partial one */
            if (bits == 3)
                encode_block8(x + a0, block, 3, 3, mids, mag_of, c, scales_out + b, d, e, carry);
            else
                encode_block8(x + a0, block, 2, 1, mids, mag_of, c, scales_out + b, d, e, carry);
            continue;
        }
#endif
        if (bits == 3 && first == 0.0f)
            encode_block(x + a0, n, block, 3, 3, mids, poly, 0, 0.0f, c, scales_out + b, d, e, carry);
        else if (bits == 3)
            encode_block(x + a0, n, block, 3, 3, mids, poly, 1, first, c, scales_out + b, d, e, carry);
        else if (first == 0.0f)
            encode_block(x + a0, n, block, 2, 1, mids, poly, 0, 0.0f, c, scales_out + b, d, e, carry);
        else
            encode_block(x + a0, n, block, 2, 1, mids, poly, 1, first, c, scales_out + b, d, e, carry);
    }
}

/* The next 8 codes' word (`bits` bytes, little-endian) at *p, and *p past them. */
static inline uint32_t next_word(const uint8_t **p, int bits) {
    uint32_t word = 0;
    for (int j = 0; j < bits; j++) word |= (uint32_t)(*p)[j] << (8 * j);
    *p += bits;
    return word;
}

/* One block of n codes at p (scale s) decoded into o (added to it if accumulate), levels lv. */
static inline void decode_block(const uint8_t *p, float s, int n, int bits, const float *lv, float *o, int accumulate) {
    int g = 0;
#ifdef __AVX2__
    /* 8 codes at a time: broadcast their word, shift each lane to its code, look the level up with one
     * permute of the (at most 8) levels; the same multiply and add per element as the loop below. */
    const __m256i shifts = _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(bits));
    const __m256i mask = _mm256_set1_epi32((1 << bits) - 1);
    const __m256 table = _mm256_loadu_ps(lv), sv = _mm256_set1_ps(s);
    for (; g + 8 <= n; g += 8) {
        const uint32_t word = next_word(&p, bits);
        const __m256i idx = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32((int)word), shifts), mask);
        __m256 d = _mm256_mul_ps(_mm256_permutevar8x32_ps(table, idx), sv);
        if (accumulate) d = _mm256_add_ps(_mm256_loadu_ps(o + g), d);
        _mm256_storeu_ps(o + g, d);
    }
#endif
    for (; g < n; g += 8) {
        const uint32_t word = next_word(&p, bits);
        const int k = n - g < 8 ? n - g : 8;
        for (int i = 0; i < k; i++) {
            const float d = lv[(word >> (bits * i)) & ((1u << bits) - 1)] * s;
            o[g + i] = accumulate ? o[g + i] + d : d;
        }
    }
}

/* Two messages' blocks (codes pa, pb; scales sa, sb) decoded together into o: o = (a + b) * mult (mult 1: a + b;
 * accumulate: o + a + b, mult 1).  One store per element instead of a store, a load and a store per message and a
 * pass for the multiply; the same fp32 operations in the same order as decode_block twice and then o *= mult. */
static inline void decode_pair_block(const uint8_t *pa, float sa, const uint8_t *pb, float sb, int n, int bits,
                                     const float *lv, float *o, int accumulate, float mult) {
    int g = 0;
#ifdef __AVX2__
    const __m256i shifts = _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(bits));
    const __m256i mask = _mm256_set1_epi32((1 << bits) - 1);
    const __m256 table = _mm256_loadu_ps(lv), va = _mm256_set1_ps(sa), vb = _mm256_set1_ps(sb);
    const __m256 vm = _mm256_set1_ps(mult);
    for (; g + 8 <= n; g += 8) {
        const uint32_t wa = next_word(&pa, bits), wb = next_word(&pb, bits);
        const __m256i ia = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32((int)wa), shifts), mask);
        const __m256i ib = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32((int)wb), shifts), mask);
        __m256 d = _mm256_mul_ps(_mm256_permutevar8x32_ps(table, ia), va);
        if (accumulate) d = _mm256_add_ps(_mm256_loadu_ps(o + g), d);
        d = _mm256_add_ps(d, _mm256_mul_ps(_mm256_permutevar8x32_ps(table, ib), vb));
        if (mult != 1.0f) d = _mm256_mul_ps(d, vm);
        _mm256_storeu_ps(o + g, d);
    }
#endif
    for (; g < n; g += 8) {
        const uint32_t wa = next_word(&pa, bits), wb = next_word(&pb, bits);
        const int k = n - g < 8 ? n - g : 8;
        const uint32_t m = (1u << bits) - 1;
        for (int i = 0; i < k; i++) {
            float d = lv[(wa >> (bits * i)) & m] * sa;
            if (accumulate) d = o[g + i] + d;
            d = d + lv[(wb >> (bits * i)) & m] * sb;
            o[g + i] = mult != 1.0f ? d * mult : d;
        }
    }
}

/* Decode m elements (as quantize.dequantize) into out; accumulate != 0: out += decoded (out + d, the
 * fp32 add torch's add_ does).  codes_b (or NULL): a second message of the same m elements, decoded and added
 * in the same pass (out = a + b, or out + a + b: a two-rank exchange's own codes and its peer's, without the
 * own decoded values written out and read back).  pq (or NULL): then each block is multiplied back, while in
 * L1, as gf_precondition_out does (out *= r, pe *= r, and with pema q's EMA; out[0] at poffset). */
static void dequantize_blocks(const uint8_t *codes_in, const uint16_t *scales, int64_t m, int bits, int block,
                              const float *poly, float first, float *out, int accumulate, const uint8_t *codes_b,
                              const uint16_t *scales_b, float mult, float *pe, float *pq, const float *pwf,
                              float pbf, int punit, int64_t poffset, int pwindow, int pema, float pbeta, float pc) {
    const int L = (1 << (bits - 1)) - 1;
    const int half = 1 << (bits - 1);
    const int64_t nb = (m + block - 1) / block;
    float lv[8] = {0};
    for (int c = 0; c < 2 * half; c++) {
        /* the sign from 1 - 2*sign, exact, as the torch path: -0.0 levels keep their sign */
        float mag = level_of((float)(c & (half - 1)), L, poly);
        if (first != 0.0f) mag = mag + first;
        lv[c] = copysignf(mag, 1.0f - 2.0f * (float)(c >> (bits - 1)));
    }
    for (int64_t b = 0; b < nb; b++) {
        const int64_t a0 = b * block;
        const int n = (int)(m - a0 < block ? m - a0 : block);
        float *o = out + a0;
        if (codes_b)
            decode_pair_block(codes_in + a0 / 8 * bits, from_bf16(scales[b]), codes_b + a0 / 8 * bits,
                              from_bf16(scales_b[b]), n, bits, lv, o, accumulate, mult);
        else {
            decode_block(codes_in + a0 / 8 * bits, from_bf16(scales[b]), n, bits, lv, o, accumulate);
            if (mult != 1.0f)
                for (int i = 0; i < n; i++) o[i] *= mult;
        }
        if (pq) gf_precondition_out(o, pe + a0, pq + a0, pwf, pbf, punit, n, poffset + a0, pwindow, pema, pbeta, pc);
    }
}

void gf_dequantize(const uint8_t *codes_in, const uint16_t *scales, int64_t m, int bits, int block,
                   const float *poly, float first, float *out, int accumulate, const uint8_t *codes_b,
                   const uint16_t *scales_b, float *pe, float *pq, const float *pwf, float pbf, int punit,
                   int64_t poffset, int pwindow, int pema, float pbeta, float pc) {
    dequantize_blocks(codes_in, scales, m, bits, block, poly, first, out, accumulate, codes_b, scales_b, 1.0f, pe, pq,
                      pwf, pbf, punit, poffset, pwindow, pema, pbeta, pc);
}

/* Rows idx[0..k) of a [*, C] fp32 matrix (C a multiple of block) encoded as one message, as gf_quantize would
 * encode the k * C packed elements (the same codes, scales and errors, block for block: no block spans two
 * rows), straight from the matrix: no packed copy.  Each row's error is written over the row itself (the
 * block is read whole before its error is written).  CSC's chunks on the quantised exchange ("cscq"). */
void gf_quantize_rows(float *rows, const int64_t *idx, int64_t k, int64_t C, int bits, int block, const float *mids,
                      const float *poly, float first, uint8_t *codes_out, uint16_t *scales_out) {
    for (int64_t r = 0; r < k; r++) {
        float *x = rows + idx[r] * C;
        gf_quantize(x, C, bits, block, mids, poly, first, codes_out + r * C / 8 * bits, scales_out + r * (C / block),
                    NULL, x, 0, NULL, NULL, 0.0f, 0, 0, 0);
    }
}

/* The inverse, into rows idx[0..k) of out: (a + b) * mult, or out + a where codes_b is NULL and accumulate
 * (mult 1); a + b added as gf_dequantize's pair decode adds them. */
void gf_dequantize_rows(const uint8_t *codes_a, const uint16_t *scales_a, const uint8_t *codes_b,
                        const uint16_t *scales_b, const int64_t *idx, int64_t k, int64_t C, int bits, int block,
                        const float *poly, float first, float *out, int accumulate, float mult) {
    for (int64_t r = 0; r < k; r++) {
        float *o = out + idx[r] * C;
        const int64_t c0 = r * C / 8 * bits, s0 = r * (C / block);
        dequantize_blocks(codes_a + c0, scales_a + s0, C, bits, block, poly, first, o, accumulate,
                          codes_b ? codes_b + c0 : NULL, codes_b ? scales_b + s0 : NULL, mult, NULL, NULL, NULL,
                          0.0f, 0, 0, 0, 0, 0.0f, 0.0f);
    }
}
