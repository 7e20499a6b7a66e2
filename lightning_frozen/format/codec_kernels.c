/* One-pass CPU kernels for the frozen-storage formats of codec.py: NF4 (64 weights a block, fp16 scale, high nibble
 * first) and int8 absmax (256 a block, fp32 scale). Plain C with AVX2 where the compiler offers it, and AVX-512 for
 * the decoders (the NF4 table in one register: twice the AVX2 decoder's rate on the project's Xeon); codec.py
 * compiles this file once per machine (native_codec.py) and calls it through ctypes, which releases the GIL, so
 * several threads can each take a range of blocks (the `_all` variants at the end split them with OpenMP). Every
 * function works on whole blocks [first, last) and writes values [first * block, min(last * block, n)); the
 * arithmetic is the tensor-op codec's, so codes and values are bit-identical to it. The code table and the NF4 bucket bounds come from Python, so both codecs use the same fp32
 * values. Returns 0, or the index + 1 of a block whose scale would overflow fp16 (NF4 encode). The fingerprint's
 * checksum (lf_checksum16) lives here too, to share the build. */
#include <math.h>
#include <stdint.h>
#include <string.h>
#ifdef __linux__
#include <sys/mman.h>
#endif
#if defined(__AVX2__) && defined(__F16C__)
#include <immintrin.h>
#define LF_AVX2 1
#endif
#if defined(LF_AVX2) && defined(__AVX512F__)
#define LF_AVX512 1 /* 16 values a register, and a 16-entry table is one permute: the NF4 code table whole */
#endif

enum { OUT_F32 = 0, OUT_BF16 = 1, OUT_F16 = 2 };
enum { NF4_BLOCK = 64, INT8_BLOCK = 256 };

static inline float half_to_float(uint16_t h) {
#ifdef LF_AVX2
    return _cvtsh_ss(h);
#else
    _Float16 value;
    memcpy(&value, &h, 2);
    return (float)value;
#endif
}

static inline uint16_t float_to_half(float f) { /* round to nearest even */
#ifdef LF_AVX2
    return _cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT);
#else
    _Float16 value = (_Float16)f;
    uint16_t h;
    memcpy(&h, &value, 2);
    return h;
#endif
}

static inline uint16_t float_to_bf16(float f) { /* round to nearest even; the weights are finite */
    uint32_t bits;
    memcpy(&bits, &f, 4);
    bits += 0x7FFFu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

static inline float bf16_to_float(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline void store_one(void *out, int out_dtype, int64_t i, float v) {
    if (out_dtype == OUT_F32)
        ((float *)out)[i] = v;
    else if (out_dtype == OUT_BF16)
        ((uint16_t *)out)[i] = float_to_bf16(v);
    else
        ((uint16_t *)out)[i] = float_to_half(v);
}

static inline float load_one(const void *in, int in_bf16, int64_t i, int64_t n) {
    if (i >= n) return 0.0f; /* padding to whole blocks */
    return in_bf16 ? bf16_to_float(((const uint16_t *)in)[i]) : ((const float *)in)[i];
}

/* Ask for transparent huge pages on a fresh output buffer: the kernel then faults it in 2 MiB at a time, not 4 KiB
 * (measured 2.7x faster first writes). Only the 2 MiB-aligned interior is advised; a no-op where THP is off. */
void lf_advise_huge_pages(void *buffer, int64_t bytes) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    const uintptr_t huge = (uintptr_t)1 << 21;
    uintptr_t start = ((uintptr_t)buffer + huge - 1) & ~(huge - 1);
    uintptr_t end = ((uintptr_t)buffer + (uintptr_t)bytes) & ~(huge - 1);
    if (end > start) madvise((void *)start, end - start, MADV_HUGEPAGE);
#else
    (void)buffer;
    (void)bytes;
#endif
}

#ifdef LF_AVX2
/* 16 NF4 values at once: the table's low and high halves in two registers, bit 3 of the code picks the half. */
static inline __m256 nf4_lookup(__m256i index, __m256 low_half, __m256 high_half) {
    __m256 low = _mm256_permutevar8x32_ps(low_half, index);
    __m256 high = _mm256_permutevar8x32_ps(high_half, index);
    return _mm256_blendv_ps(low, high, _mm256_castsi256_ps(_mm256_slli_epi32(index, 28)));
}

static inline void store8(void *out, int out_dtype, int64_t i, __m256 v) {
    if (out_dtype == OUT_F32) {
        _mm256_storeu_ps((float *)out + i, v);
    } else if (out_dtype == OUT_F16) {
        _mm_storeu_si128((__m128i *)((uint16_t *)out + i), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
    } else {
        __m256i bits = _mm256_castps_si256(v);
        __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
        bits = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF))), 16);
        __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(bits, bits), 0x08);
        _mm_storeu_si128((__m128i *)((uint16_t *)out + i), _mm256_castsi256_si128(packed));
    }
}
#endif

#ifdef LF_AVX512
/* store8 for 16 lanes: the same roundings, another register width */
static inline void store16(void *out, int out_dtype, int64_t i, __m512 v) {
    if (out_dtype == OUT_F32) {
        _mm512_storeu_ps((float *)out + i, v);
    } else if (out_dtype == OUT_F16) {
        _mm256_storeu_si256((__m256i *)((uint16_t *)out + i), _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
    } else {
        __m512i bits = _mm512_castps_si512(v);
        __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
        bits = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF))), 16);
        _mm256_storeu_si256((__m256i *)((uint16_t *)out + i), _mm512_cvtepi32_epi16(bits));
    }
}
#endif

int lf_nf4_decode(const uint8_t *codes, const uint16_t *scales, const float *table, int64_t first, int64_t last,
                  int64_t n, void *out, int out_dtype) {
#ifdef LF_AVX512
    const __m512 whole_table = _mm512_loadu_ps(table);
    /* each byte twice, its high nibble (shifted down 4) first: permutexvar reads the low 4 bits of each index */
    const __m512i shifts = _mm512_set_epi32(0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4);
#endif
    for (int64_t block = first; block < last; ++block) {
        const float scale = half_to_float(scales[block]);
        const uint8_t *byte = codes + block * (NF4_BLOCK / 2);
        const int64_t start = block * NF4_BLOCK;
        int64_t done = 0;
#ifdef LF_AVX512
        if (start + NF4_BLOCK <= n) {
            const __m512 wide = _mm512_set1_ps(scale);
            for (; done < NF4_BLOCK; done += 16) {
                const __m128i eight = _mm_loadl_epi64((const __m128i *)(byte + done / 2));
                const __m512i index = _mm512_srlv_epi32(_mm512_cvtepu8_epi32(_mm_unpacklo_epi8(eight, eight)), shifts);
                store16(out, out_dtype, start + done, _mm512_mul_ps(_mm512_permutexvar_ps(index, whole_table), wide));
            }
        }
#elif defined(LF_AVX2)
        if (start + NF4_BLOCK <= n) {
            const __m256 low_half = _mm256_loadu_ps(table), high_half = _mm256_loadu_ps(table + 8);
            const __m256 wide = _mm256_set1_ps(scale);
            const __m256i nibble = _mm256_set1_epi32(0x0F);
            for (; done < NF4_BLOCK; done += 16) {
                __m256i pair = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(byte + done / 2)));
                __m256 high = _mm256_mul_ps(nf4_lookup(_mm256_srli_epi32(pair, 4), low_half, high_half), wide);
                __m256 low = _mm256_mul_ps(nf4_lookup(_mm256_and_si256(pair, nibble), low_half, high_half), wide);
                __m256 a = _mm256_unpacklo_ps(high, low), b = _mm256_unpackhi_ps(high, low);
                store8(out, out_dtype, start + done, _mm256_permute2f128_ps(a, b, 0x20));
                store8(out, out_dtype, start + done + 8, _mm256_permute2f128_ps(a, b, 0x31));
            }
        }
#endif
        for (; done < NF4_BLOCK && start + done < n; done += 2) {
            store_one(out, out_dtype, start + done, table[byte[done / 2] >> 4] * scale);
            if (start + done + 1 < n) store_one(out, out_dtype, start + done + 1, table[byte[done / 2] & 0x0F] * scale);
        }
    }
    return 0;
}

#ifdef LF_AVX2
static inline float absmax8(const float *block, int count) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 high = _mm256_setzero_ps();
    for (int i = 0; i < count; i += 8) high = _mm256_max_ps(high, _mm256_andnot_ps(sign, _mm256_loadu_ps(block + i)));
    __m128 half = _mm_max_ps(_mm256_castps256_ps128(high), _mm256_extractf128_ps(high, 1));
    half = _mm_max_ps(half, _mm_movehl_ps(half, half));
    half = _mm_max_ss(half, _mm_shuffle_ps(half, half, 1));
    return _mm_cvtss_f32(half);
}
#endif

static inline float block_absmax(const float *block, int count) {
#ifdef LF_AVX2
    return absmax8(block, count);
#else
    float absmax = 0.0f;
    for (int i = 0; i < count; ++i) absmax = fmaxf(absmax, fabsf(block[i]));
    return absmax;
#endif
}

/* A block of fp32 weights: straight from the source, or widened (bf16) and zero-padded past n into `scratch`. */
static inline const float *block_values(const void *values, int in_bf16, int64_t start, int64_t n, int count,
                                        float *scratch) {
    if (!in_bf16 && start + count <= n) return (const float *)values + start;
    for (int i = 0; i < count; ++i) scratch[i] = load_one(values, in_bf16, start + i, n);
    return scratch;
}

int lf_nf4_encode(const void *values, int in_bf16, int64_t n, const float *bounds, int64_t first, int64_t last,
                  uint8_t *codes, uint16_t *scales) {
    float scratch[NF4_BLOCK];
    for (int64_t b = first; b < last; ++b) {
        const float *block = block_values(values, in_bf16, b * NF4_BLOCK, n, NF4_BLOCK, scratch);
        const float absmax = block_absmax(block, NF4_BLOCK);
        if (absmax > 65504.0f) return (int)(b + 1);
        uint16_t scale = float_to_half(absmax);
        if (half_to_float(scale) < absmax) scale += 1; /* the next fp16 up: no weight leaves [-1, 1] */
        scales[b] = scale;
        const float divisor = scale ? half_to_float(scale) : 1.0f;
        uint8_t *out = codes + b * (NF4_BLOCK / 2);
        int i = 0;
#ifdef LF_AVX2
        const __m256 wide = _mm256_set1_ps(divisor);
        for (; i < NF4_BLOCK; i += 8) {
            const __m256 normalized = _mm256_div_ps(_mm256_loadu_ps(block + i), wide);
            __m256i above = _mm256_setzero_si256();
            for (int k = 0; k < 15; ++k) /* a true compare is -1: subtracting counts the bounds below the weight */
                above = _mm256_sub_epi32(
                    above, _mm256_castps_si256(_mm256_cmp_ps(normalized, _mm256_set1_ps(bounds[k]), _CMP_GT_OQ)));
            /* each 64-bit lane holds two neighbours' codes: the first into the high nibble of its low byte */
            __m256i pairs = _mm256_or_si256(_mm256_slli_epi64(above, 4), _mm256_srli_epi64(above, 32));
            int64_t lanes[4];
            _mm256_storeu_si256((__m256i *)lanes, pairs);
            for (int lane = 0; lane < 4; ++lane) out[i / 2 + lane] = (uint8_t)lanes[lane];
        }
#endif
        for (; i < NF4_BLOCK; i += 2) {
            uint8_t pair[2] = {0, 0};
            for (int j = 0; j < 2; ++j) {
                const float normalized = block[i + j] / divisor;
                for (int k = 0; k < 15; ++k) pair[j] += normalized > bounds[k];
            }
            out[i / 2] = (uint8_t)(pair[0] << 4 | pair[1]);
        }
    }
    return 0;
}

int lf_int8_decode(const int8_t *codes, const float *scales, int64_t first, int64_t last, int64_t n, void *out,
                   int out_dtype) {
    for (int64_t b = first; b < last; ++b) {
        const float step = scales[b] / 127.0f;
        const int64_t start = b * INT8_BLOCK;
        int64_t i = 0;
#ifdef LF_AVX512
        if (start + INT8_BLOCK <= n) {
            const __m512 wide = _mm512_set1_ps(step);
            for (; i < INT8_BLOCK; i += 16) {
                __m512i code = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(codes + start + i)));
                store16(out, out_dtype, start + i, _mm512_mul_ps(_mm512_cvtepi32_ps(code), wide));
            }
        }
#elif defined(LF_AVX2)
        if (start + INT8_BLOCK <= n) {
            const __m256 wide = _mm256_set1_ps(step);
            for (; i < INT8_BLOCK; i += 8) {
                __m256i code = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(codes + start + i)));
                store8(out, out_dtype, start + i, _mm256_mul_ps(_mm256_cvtepi32_ps(code), wide));
            }
        }
#endif
        for (; i < INT8_BLOCK && start + i < n; ++i) store_one(out, out_dtype, start + i, (float)codes[start + i] * step);
    }
    return 0;
}

int lf_int8_encode(const void *values, int in_bf16, int64_t n, int64_t first, int64_t last, int8_t *codes,
                   float *scales) {
    float scratch[INT8_BLOCK];
    for (int64_t b = first; b < last; ++b) {
        const float *block = block_values(values, in_bf16, b * INT8_BLOCK, n, INT8_BLOCK, scratch);
        const float absmax = block_absmax(block, INT8_BLOCK);
        scales[b] = absmax;
        /* torch's `127.0 / absmax` is a reciprocal times 127: the same two roundings */
        const float inverse = absmax > 0.0f ? (1.0f / absmax) * 127.0f : 0.0f;
        int8_t *out = codes + b * INT8_BLOCK;
        int i = 0;
#ifdef LF_AVX2
        const __m256 wide = _mm256_set1_ps(inverse), top = _mm256_set1_ps(127.0f), bottom = _mm256_set1_ps(-127.0f);
        for (; i < INT8_BLOCK; i += 8) { /* round half to even, as torch.round, then clamp */
            __m256 code = _mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(block + i), wide),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            __m256i whole = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(code, bottom), top));
            __m128i shorts = _mm_packs_epi32(_mm256_castsi256_si128(whole), _mm256_extracti128_si256(whole, 1));
            _mm_storel_epi64((__m128i *)(out + i), _mm_packs_epi16(shorts, shorts));
        }
#endif
        for (; i < INT8_BLOCK; ++i) out[i] = (int8_t)fminf(fmaxf(rintf(block[i] * inverse), -127.0f), 127.0f);
    }
    return 0;
}

/* The checksums of base/fingerprint.py's `Checksummer`, in one pass: over the 16-bit pattern of each value (an fp32
 * value cast to bf16 and to fp16, rounding to nearest even as torch does; a bf16 or fp16 value as it is), read as a
 * signed integer, the plain sum and the sum weighted by (global index % WEIGHT_PERIOD) + 1, each modulo 2**61 - 1.
 * Works on units [first, last) of CHECKSUM_UNIT values and writes its sums into out (fp32: bf16 plain, bf16 weighted,
 * fp16 plain, fp16 weighted; a 16-bit dtype: plain, weighted). Returns 1 if an fp32 value is NaN (torch's casts do not
 * agree on its pattern: the caller uses torch's), else 0. */
enum { CHECKSUM_UNIT = 1 << 20, WEIGHT_PERIOD = 65521 };
enum { IN_F32 = 0 };
static const int64_t CHECKSUM_MODULUS = ((int64_t)1 << 61) - 1;

static inline int64_t modulo(__int128 sum) {
    const int64_t rest = (int64_t)(sum % CHECKSUM_MODULUS);
    return rest < 0 ? rest + CHECKSUM_MODULUS : rest;
}

/* one run of weights phase + 1, phase + 2, ... (no wrap): each product fits int32 (32768 * 65521 < 2**31) */
static int checksum_f32_run(const float *x, int64_t count, int32_t weight, int64_t sums[4]) {
    int64_t j = 0;
    int nan = 0;
#ifdef LF_AVX2
    const __m256i one = _mm256_set1_epi32(1), bias = _mm256_set1_epi32(0x7FFF), step = _mm256_set1_epi32(8);
    __m256i weights = _mm256_add_epi32(_mm256_set1_epi32(weight), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    __m256i plain_b = _mm256_setzero_si256(), plain_h = _mm256_setzero_si256();
    __m256i wide_b = _mm256_setzero_si256(), wide_h = _mm256_setzero_si256();
    for (; j + 8 <= count; j += 8) {
        const __m256 v = _mm256_loadu_ps(x + j);
        nan |= _mm256_movemask_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        const __m256i bits = _mm256_castps_si256(v);
        const __m256i even = _mm256_and_si256(_mm256_srli_epi32(bits, 16), one);
        const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(bias, even)), 16);
        const __m256i b = _mm256_srai_epi32(_mm256_slli_epi32(rounded, 16), 16);
        const __m256i h = _mm256_cvtepi16_epi32(_mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        plain_b = _mm256_add_epi32(plain_b, b); /* per lane at most 8191 values of 32768: no overflow in a run */
        plain_h = _mm256_add_epi32(plain_h, h);
        const __m256i pb = _mm256_mullo_epi32(b, weights), ph = _mm256_mullo_epi32(h, weights);
        wide_b = _mm256_add_epi64(wide_b, _mm256_add_epi64(_mm256_cvtepi32_epi64(_mm256_castsi256_si128(pb)),
                                                           _mm256_cvtepi32_epi64(_mm256_extracti128_si256(pb, 1))));
        wide_h = _mm256_add_epi64(wide_h, _mm256_add_epi64(_mm256_cvtepi32_epi64(_mm256_castsi256_si128(ph)),
                                                           _mm256_cvtepi32_epi64(_mm256_extracti128_si256(ph, 1))));
        weights = _mm256_add_epi32(weights, step);
    }
    int32_t lanes32[8];
    int64_t lanes64[4];
    _mm256_storeu_si256((__m256i *)lanes32, plain_b);
    for (int k = 0; k < 8; ++k) sums[0] += lanes32[k];
    _mm256_storeu_si256((__m256i *)lanes32, plain_h);
    for (int k = 0; k < 8; ++k) sums[2] += lanes32[k];
    _mm256_storeu_si256((__m256i *)lanes64, wide_b);
    for (int k = 0; k < 4; ++k) sums[1] += lanes64[k];
    _mm256_storeu_si256((__m256i *)lanes64, wide_h);
    for (int k = 0; k < 4; ++k) sums[3] += lanes64[k];
#endif
    for (; j < count; ++j) {
        uint32_t bits;
        memcpy(&bits, x + j, 4);
        nan |= (bits & 0x7FFFFFFFu) > 0x7F800000u;
        const int32_t b = (int16_t)float_to_bf16(x[j]), h = (int16_t)float_to_half(x[j]), w = weight + (int32_t)j;
        sums[0] += b;
        sums[1] += (int64_t)(b * w);
        sums[2] += h;
        sums[3] += (int64_t)(h * w);
    }
    return nan != 0;
}

static void checksum_16_run(const int16_t *x, int64_t count, int32_t weight, int64_t sums[2]) {
    for (int64_t j = 0; j < count; ++j) {
        sums[0] += x[j];
        sums[1] += (int64_t)(x[j] * (weight + (int32_t)j));
    }
}

int lf_checksum16(const void *values, int in_dtype, int64_t n, int64_t start, int64_t first, int64_t last,
                  int64_t *out) {
    const int64_t begin = first * CHECKSUM_UNIT, end = last * CHECKSUM_UNIT < n ? last * CHECKSUM_UNIT : n;
    __int128 totals[4] = {0};
    for (int64_t i = begin; i < end;) {
        const int64_t phase = (start + i) % WEIGHT_PERIOD;
        const int64_t stop = end - i < WEIGHT_PERIOD - phase ? end : i + (WEIGHT_PERIOD - phase);
        int64_t sums[4] = {0};
        if (in_dtype == IN_F32) {
            if (checksum_f32_run((const float *)values + i, stop - i, (int32_t)phase + 1, sums)) return 1;
        } else {
            checksum_16_run((const int16_t *)values + i, stop - i, (int32_t)phase + 1, sums);
        }
        for (int k = 0; k < 4; ++k) totals[k] += sums[k];
        i = stop;
    }
    for (int k = 0; k < (in_dtype == IN_F32 ? 4 : 2); ++k) out[k] = modulo(totals[k]);
    return 0;
}

/* The whole tensor, its blocks split over the threads of the OpenMP runtime already loaded in the process (torch's
 * own: the loader reuses the libgomp.so.1 that torch brought), so a decode that follows a matmul shares torch's
 * threads instead of competing with them while they spin. Each returns the first nonzero status of its ranges. */
#ifdef _OPENMP
#include <omp.h>
enum { MAX_CHUNKS = 256 };

int lf_openmp(void) { return 1; }

static int64_t chunk_count(int64_t blocks, int64_t min_blocks) {
    int64_t threads = omp_get_max_threads(), by_size = blocks / (min_blocks > 0 ? min_blocks : 1);
    int64_t chunks = threads < by_size ? threads : by_size;
    return chunks < 1 ? 1 : (chunks > MAX_CHUNKS ? MAX_CHUNKS : chunks);
}

#define LF_OVER_CHUNKS(blocks, min_blocks, call)                                                                     \
    do {                                                                                                             \
        const int64_t chunks = chunk_count(blocks, min_blocks);                                                      \
        int statuses[MAX_CHUNKS] = {0};                                                                              \
        _Pragma("omp parallel for schedule(static) num_threads(chunks) if(chunks > 1)")                              \
        for (int64_t chunk = 0; chunk < chunks; ++chunk) {                                                           \
            const int64_t first = blocks * chunk / chunks, last = blocks * (chunk + 1) / chunks;                     \
            statuses[chunk] = (call);                                                                                \
        }                                                                                                            \
        for (int64_t chunk = 0; chunk < chunks; ++chunk)                                                             \
            if (statuses[chunk]) return statuses[chunk];                                                             \
        return 0;                                                                                                    \
    } while (0)

int lf_nf4_decode_all(const uint8_t *codes, const uint16_t *scales, const float *table, int64_t blocks,
                      int64_t min_blocks, int64_t n, void *out, int out_dtype) {
    LF_OVER_CHUNKS(blocks, min_blocks, lf_nf4_decode(codes, scales, table, first, last, n, out, out_dtype));
}

int lf_nf4_encode_all(const void *values, int in_bf16, int64_t n, const float *bounds, int64_t blocks,
                      int64_t min_blocks, uint8_t *codes, uint16_t *scales) {
    LF_OVER_CHUNKS(blocks, min_blocks, lf_nf4_encode(values, in_bf16, n, bounds, first, last, codes, scales));
}

int lf_int8_decode_all(const int8_t *codes, const float *scales, int64_t blocks, int64_t min_blocks, int64_t n,
                       void *out, int out_dtype) {
    LF_OVER_CHUNKS(blocks, min_blocks, lf_int8_decode(codes, scales, first, last, n, out, out_dtype));
}

int lf_int8_encode_all(const void *values, int in_bf16, int64_t n, int64_t blocks, int64_t min_blocks, int8_t *codes,
                       float *scales) {
    LF_OVER_CHUNKS(blocks, min_blocks, lf_int8_encode(values, in_bf16, n, first, last, codes, scales));
}

/* out: 4 sums per unit, each range writing at its first unit's row */
int lf_checksum16_all(const void *values, int in_dtype, int64_t n, int64_t start, int64_t units, int64_t min_units,
                      int64_t *out) {
    LF_OVER_CHUNKS(units, min_units, lf_checksum16(values, in_dtype, n, start, first, last, out + 4 * first));
}

/* A team of OpenMP threads asleep for a run: lf_openmp_hold, then lf_openmp_park on a thread of its own (it returns when
 * lf_openmp_release is called). While the team lives, libgomp manages more threads than the CPUs it may use, and a
 * thread waiting for the others in any parallel region spins GOMP_SPINCOUNT's throttled count (100) before it
 * sleeps, not 300,000 (libgomp's manual, GOMP_SPINCOUNT): docs/internals.md, "Steadiness of a step". */
#include <pthread.h>
static pthread_mutex_t parked_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t parked_wake = PTHREAD_COND_INITIALIZER;
static int parked_held = 0;

void lf_openmp_hold(void) {
    pthread_mutex_lock(&parked_lock);
    parked_held = 1;
    pthread_mutex_unlock(&parked_lock);
}

int lf_openmp_park(int threads) {
    int joined = 0;
#pragma omp parallel num_threads(threads)
    {
#pragma omp atomic
        ++joined;
        pthread_mutex_lock(&parked_lock);
        while (parked_held) pthread_cond_wait(&parked_wake, &parked_lock);
        pthread_mutex_unlock(&parked_lock);
    }
    return joined;
}

void lf_openmp_release(void) {
    pthread_mutex_lock(&parked_lock);
    parked_held = 0;
    pthread_cond_broadcast(&parked_wake);
    pthread_mutex_unlock(&parked_lock);
}
/* A frozen linear layer's matmul from its codes (zero/compute/coded_linear.py): each thread takes every threads-th
 * block of tile_rows output rows, decodes tile_cols input columns of them at a time into a buffer of its own and
 * multiplies them with torch's own BLAS (`sgemm`, single-threaded inside this region) while they are in its cache.
 * The weight is N x K, row-major, from flat index `offset` of a gathered param held as `shards` encoded shards of
 * `shard_numel` values (codes and scales per shard); K, shard_numel, offset and tile_cols whole blocks. fp32 only. */
typedef void (*lf_sgemm_t)(const char *, const char *, const int *, const int *, const int *, const float *,
                           const float *, const int *, const float *, const int *, const float *, float *, const int *);

static void coded_range(int nf4, const void *const *codes, const void *const *scales, const float *table,
                        int64_t shard_numel, int64_t start, int64_t count, float *out) {
    while (count > 0) {
        const int64_t shard = start / shard_numel, first = start % shard_numel;
        const int64_t take = count < shard_numel - first ? count : shard_numel - first;
        if (nf4)
            lf_nf4_decode((const uint8_t *)codes[shard] + first / 2, (const uint16_t *)scales[shard] + first / NF4_BLOCK,
                          table, 0, (take + NF4_BLOCK - 1) / NF4_BLOCK, take, out, 0);
        else
            lf_int8_decode((const int8_t *)codes[shard] + first, (const float *)scales[shard] + first / INT8_BLOCK, 0,
                           (take + INT8_BLOCK - 1) / INT8_BLOCK, take, out, 0);
        start += take, count -= take, out += take;
    }
}

/* rows r0.. (`rows` of them), columns c0.. (`cols`) of the weight into buf, `cols` values a row */
static void coded_tile(int nf4, const void *const *codes, const void *const *scales, const float *table,
                       int64_t shard_numel, int64_t offset, int64_t K, int64_t r0, int64_t rows, int64_t c0,
                       int64_t cols, float *buf) {
    if (cols == K) {
        coded_range(nf4, codes, scales, table, shard_numel, offset + r0 * K, rows * K, buf);
        return;
    }
    for (int64_t r = 0; r < rows; ++r)
        coded_range(nf4, codes, scales, table, shard_numel, offset + (r0 + r) * K + c0, cols, buf + r * cols);
}

/* out (M x N) = x (M x K) @ weight.T; buffers: threads * tile_rows * tile_cols floats */
int lf_coded_matmul(void *sgemm, int nf4, const void *const *codes, const void *const *scales, const float *table,
                    int64_t shard_numel, int64_t offset, int64_t M, int64_t N, int64_t K, const float *x, float *out,
                    int64_t tile_rows, int64_t tile_cols, float *buffers, int threads) {
    const lf_sgemm_t gemm = (lf_sgemm_t)sgemm;
    const int64_t tiles = (N + tile_rows - 1) / tile_rows;
#pragma omp parallel num_threads(threads)
    {
        const int64_t thread = omp_get_thread_num(), team = omp_get_num_threads();
        float *buf = buffers + thread * tile_rows * tile_cols;
        const float one = 1.0f, zero = 0.0f;
        const int m = (int)M, k = (int)K, n = (int)N;
        for (int64_t tile = thread; tile < tiles; tile += team) {
            const int64_t r0 = tile * tile_rows, rows = N - r0 < tile_rows ? N - r0 : tile_rows;
            for (int64_t c0 = 0; c0 < K; c0 += tile_cols) {
                const int64_t cols = K - c0 < tile_cols ? K - c0 : tile_cols;
                coded_tile(nf4, codes, scales, table, shard_numel, offset, K, r0, rows, c0, cols, buf);
                const int r = (int)rows, c = (int)cols;
                /* column-major: out.T[r0:, :] (rows x M) = buf.T (rows x cols, stored cols x rows) @ x.T[c0:, :] */
                gemm("T", "N", &r, &m, &c, &one, buf, &c, x + c0, &k, c0 ? &one : &zero, out + r0, &n);
            }
        }
    }
    return 0;
}

/* grad_input (M x K) = grad (M x N) @ weight: each thread takes every threads-th block of tile_cols input columns and
 * runs down the weight's rows for it, so each part of grad_input is summed by one thread and nothing is reduced */
int lf_coded_matmul_grad(void *sgemm, int nf4, const void *const *codes, const void *const *scales,
                         const float *table, int64_t shard_numel, int64_t offset, int64_t M, int64_t N, int64_t K,
                         const float *grad, float *grad_input, int64_t tile_rows, int64_t tile_cols, float *buffers,
                         int threads) {
    const lf_sgemm_t gemm = (lf_sgemm_t)sgemm;
    const int64_t tiles = (K + tile_cols - 1) / tile_cols;
#pragma omp parallel num_threads(threads)
    {
        const int64_t thread = omp_get_thread_num(), team = omp_get_num_threads();
        float *buf = buffers + thread * tile_rows * tile_cols;
        const float one = 1.0f, zero = 0.0f;
        const int m = (int)M, k = (int)K, n = (int)N;
        for (int64_t tile = thread; tile < tiles; tile += team) {
            const int64_t c0 = tile * tile_cols, cols = K - c0 < tile_cols ? K - c0 : tile_cols;
            for (int64_t r0 = 0; r0 < N; r0 += tile_rows) {
                const int64_t rows = N - r0 < tile_rows ? N - r0 : tile_rows;
                coded_tile(nf4, codes, scales, table, shard_numel, offset, K, r0, rows, c0, cols, buf);
                const int r = (int)rows, c = (int)cols;
                /* column-major: grad_input.T[c0:, :] (cols x M) (+)= buf (cols x rows) @ grad.T[r0:, :] (rows x M) */
                gemm("N", "N", &c, &m, &r, &one, buf, &c, grad + r0, &n, r0 ? &one : &zero, grad_input + c0, &k);
            }
        }
    }
    return 0;
}
#else
int lf_openmp(void) { return 0; }
#endif
