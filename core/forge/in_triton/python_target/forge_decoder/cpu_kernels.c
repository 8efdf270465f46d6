/* forge's C kernels for the decoding step on a CPU with AVX-512 (cpu_kernels.py compiles and loads them).
 *
 * forge_attend, the step's attention over the KV cache. One unit of work per (row, key/value head): the query heads sharing that key/value head ("group") read the
 * row's columns [0, n) once, n = min(position + 1, columns): its static slot, or its blocks through the row's
 * block table. Scores, softmax and the weighted sum run in float32 registers, CHUNK columns at a time (online
 * softmax: running maximum and sum per query head). The units are split over the calling thread's OpenMP team,
 * which is torch's own (libgomp is shared by soname once torch has loaded it).
 *
 * forge_picks, each row's greedy pick of the logits: its argmax (the first, as torch's) and that token's
 * log-probability, max - log(sum(exp(x - max))), a banned token left out; two passes over the row in float32.
 *
 * forge_rms_norm, a Llama RMSNorm as the decoder writes it in torch (architectures._rms): float32 statistics, the
 * normalized row rounded to the input dtype, then times the weight in that dtype; one call instead of four ops.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#ifndef __AVX512F__
#error "cpu_kernels needs AVX-512"
#endif

#define CHUNK 64   /* columns scored before they are weighed */
#define MAX_GROUP 16
#define MAX_LANES 16 /* head dim up to 256, in vectors of 16 floats */

typedef struct {
    int64_t row, head, column; /* strides, in elements, of a layer's cache (static: [rows, kv, columns, dim];
                                  paged: [blocks, kv, block, dim]) */
    const int64_t *table;      /* paged: [rows, table_width] block ids; static: NULL */
    int64_t table_width;
    int64_t block;
} Layout;

static inline int64_t offset(const Layout *at, int64_t r, int64_t h, int64_t c) {
    if (!at->table)
        return r * at->row + h * at->head + c * at->column;
    return at->table[r * at->table_width + c / at->block] * at->row + h * at->head + (c % at->block) * at->column;
}

static inline __m512 load_bf16(const uint16_t *p) {
    __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

static inline float from_bf16(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t store_bf16(float f) { /* round to nearest even, NaN kept a NaN */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u)
        return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* e^x for x <= 0: 2^t, t = x log2(e) = n + f with n = round(t), |f| <= 1/2, 2^f by its Taylor series to f^7
   (relative error below 1e-8), scaled by 2^n */
static inline __m512 exp_ps(__m512 x) {
    __m512 t = _mm512_mul_ps(_mm512_max_ps(x, _mm512_set1_ps(-126.0f)), _mm512_set1_ps(1.44269504088896341f));
    __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 f = _mm512_sub_ps(t, n);
    __m512 p = _mm512_set1_ps(1.5252734e-5f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.5403530e-4f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504109e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022651e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

/* One (row, kv head): q and out point at its group's [group, dim] query and output rows; bf16 says whether
   elements are bfloat16 (else float32). */
static void attend_unit(const void *q, const void *k, const void *v, void *out, int bf16, int64_t r, int64_t h,
                        int64_t n, int group, int dim, const Layout *at) {
    const int lanes = dim / 16;
    __m512 qv[MAX_GROUP][MAX_LANES], acc[MAX_GROUP][MAX_LANES], row[MAX_LANES];
    float score[MAX_GROUP][CHUNK] __attribute__((aligned(64)));
    float top[MAX_GROUP], total[MAX_GROUP];
    for (int g = 0; g < group; g++) {
        for (int x = 0; x < lanes; x++) {
            qv[g][x] = bf16 ? load_bf16((const uint16_t *)q + g * dim + 16 * x)
                            : _mm512_loadu_ps((const float *)q + g * dim + 16 * x);
            acc[g][x] = _mm512_setzero_ps();
        }
        top[g] = -INFINITY;
        total[g] = 0.0f;
    }
    for (int64_t start = 0; start < n; start += CHUNK) {
        const int width = (int)(n - start < CHUNK ? n - start : CHUNK);
        const int padded = (width + 15) / 16 * 16;
        for (int j = 0; j < width; j++) {
            const int64_t o = offset(at, r, h, start + j);
            for (int x = 0; x < lanes; x++)
                row[x] = bf16 ? load_bf16((const uint16_t *)k + o + 16 * x) : _mm512_loadu_ps((const float *)k + o + 16 * x);
            for (int g = 0; g < group; g++) {
                __m512 dot = _mm512_mul_ps(qv[g][0], row[0]);
                for (int x = 1; x < lanes; x++)
                    dot = _mm512_fmadd_ps(qv[g][x], row[x], dot);
                score[g][j] = _mm512_reduce_add_ps(dot);
            }
        }
        for (int g = 0; g < group; g++) {
            float high = top[g];
            for (int j = 0; j < width; j++)
                high = score[g][j] > high ? score[g][j] : high;
            for (int j = width; j < padded; j++)
                score[g][j] = -INFINITY;
            const __m512 shift = _mm512_set1_ps(high);
            __m512 sum = _mm512_setzero_ps();
            for (int j = 0; j < padded; j += 16) {
                __m512 e = exp_ps(_mm512_sub_ps(_mm512_load_ps(&score[g][j]), shift));
                _mm512_store_ps(&score[g][j], e);
                sum = _mm512_add_ps(sum, e);
            }
            const float rescale = top[g] == -INFINITY ? 0.0f : expf(top[g] - high);
            total[g] = total[g] * rescale + _mm512_reduce_add_ps(sum);
            top[g] = high;
            for (int x = 0; x < lanes; x++)
                acc[g][x] = _mm512_mul_ps(acc[g][x], _mm512_set1_ps(rescale));
        }
        for (int j = 0; j < width; j++) {
            const int64_t o = offset(at, r, h, start + j);
            for (int x = 0; x < lanes; x++)
                row[x] = bf16 ? load_bf16((const uint16_t *)v + o + 16 * x) : _mm512_loadu_ps((const float *)v + o + 16 * x);
            for (int g = 0; g < group; g++) {
                const __m512 p = _mm512_set1_ps(score[g][j]);
                for (int x = 0; x < lanes; x++)
                    acc[g][x] = _mm512_fmadd_ps(p, row[x], acc[g][x]);
            }
        }
    }
    for (int g = 0; g < group; g++) {
        const __m512 inverse = _mm512_set1_ps(1.0f / total[g]);
        if (!bf16) {
            for (int x = 0; x < lanes; x++)
                _mm512_storeu_ps((float *)out + g * dim + 16 * x, _mm512_mul_ps(acc[g][x], inverse));
            continue;
        }
        float plain[MAX_LANES * 16] __attribute__((aligned(64)));
        for (int x = 0; x < lanes; x++)
            _mm512_store_ps(plain + 16 * x, _mm512_mul_ps(acc[g][x], inverse));
        for (int d = 0; d < dim; d++)
            ((uint16_t *)out)[g * dim + d] = store_bf16(plain[d]);
    }
}

/* q: [rows, kv * group, dim], scaled already, its rows q_row elements apart (each row's heads contiguous: a slice
   of the rotated queries and keys needs no copy); out: the same shape, contiguous; k, v: a layer's cache (Layout);
   positions: [rows], each row's own position; new_k, new_v (may be NULL: written already): the step's keys and
   values, [rows, kv, dim] with strides (k_row, k_head) and (v_row, v_head) (dim contiguous), written at each row's
   position first. A row attends to columns [0, min(position + 1, columns)). Returns 0, or -1 for shapes it does
   not take. */
int forge_attend(const void *q, void *k, void *v, void *out, const int64_t *positions, int rows, int kv, int group,
                 int dim, int bf16, int64_t columns, int64_t stride_row, int64_t stride_head, int64_t stride_column,
                 const int64_t *table, int64_t table_width, int64_t block, const void *new_k, const void *new_v,
                 int64_t k_row, int64_t k_head, int64_t v_row, int64_t v_head, int64_t q_row, int threads) {
    if (group < 1 || group > MAX_GROUP || dim < 16 || dim > 16 * MAX_LANES || dim % 16)
        return -1;
    const Layout at = {stride_row, stride_head, stride_column, table, table_width, block};
    const int64_t element = bf16 ? 2 : 4, unit_size = (int64_t)group * dim * element;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int unit = 0; unit < rows * kv; unit++) {
        const int64_t r = unit / kv, h = unit % kv;
        if (new_k) { /* only this unit reads or writes its row's head: no other thread touches these columns */
            const int64_t o = offset(&at, r, h, positions[r]) * element;
            memcpy((char *)k + o, (const char *)new_k + (r * k_row + h * k_head) * element, dim * element);
            memcpy((char *)v + o, (const char *)new_v + (r * v_row + h * v_head) * element, dim * element);
        }
        const int64_t n = positions[r] + 1 < columns ? positions[r] + 1 : columns;
        attend_unit((const char *)q + r * q_row * element + h * unit_size, k, v, (char *)out + unit * unit_size,
                    bf16, r, h, n, group, dim, &at);
    }
    return 0;
}

/* x, out: [rows, hidden] contiguous; weight: [hidden]. out = weight * dtype(x / sqrt(mean(x^2) + eps)). */
int forge_rms_norm(const void *x, const void *weight, void *out, int rows, int hidden, int bf16, float eps,
                   int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if ((int64_t)rows * hidden >= 65536)
    for (int r = 0; r < rows; r++) {
        const int64_t base = (int64_t)r * hidden;
        __m512 squares = _mm512_setzero_ps();
        int d = 0;
        for (; d + 16 <= hidden; d += 16) {
            const __m512 v = bf16 ? load_bf16((const uint16_t *)x + base + d) : _mm512_loadu_ps((const float *)x + base + d);
            squares = _mm512_fmadd_ps(v, v, squares);
        }
        float sum = _mm512_reduce_add_ps(squares);
        for (; d < hidden; d++) {
            const float v = bf16 ? from_bf16(((const uint16_t *)x)[base + d]) : ((const float *)x)[base + d];
            sum += v * v;
        }
        const float scale = 1.0f / sqrtf(sum / (float)hidden + eps);
        for (d = 0; d < hidden; d++) {
            if (bf16) {
                const float normed = from_bf16(store_bf16(from_bf16(((const uint16_t *)x)[base + d]) * scale));
                ((uint16_t *)out)[base + d] = store_bf16(from_bf16(((const uint16_t *)weight)[d]) * normed);
            } else {
                ((float *)out)[base + d] = ((const float *)weight)[d] * (((const float *)x)[base + d] * scale);
            }
        }
    }
    return 0;
}

/* logits: [rows, vocab] (row stride in elements); banned: [rows] a token to leave out (-1: none) or NULL;
   out: [rows, 2] float32 (the token as a float, its log-probability), as graphs.GraphDecoder._picks. */
int forge_picks(const void *logits, int rows, int vocab, int64_t row_stride, int bf16, const int64_t *banned,
                float *out, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if ((int64_t)rows * vocab >= 65536)
    for (int r = 0; r < rows; r++) {
        const int64_t base = (int64_t)r * row_stride;
        const int64_t skip = banned ? banned[r] : -1;
        __m512 best = _mm512_set1_ps(-INFINITY);
        __m512i where = _mm512_set1_epi32(0x7fffffff), lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10,
                                                                                  11, 12, 13, 14, 15);
        int v = 0;
        for (; v + 16 <= vocab; v += 16) {
            __m512 x = bf16 ? load_bf16((const uint16_t *)logits + base + v) : _mm512_loadu_ps((const float *)logits + base + v);
            if (skip >= v && skip < v + 16)
                x = _mm512_mask_mov_ps(x, (__mmask16)(1u << (skip - v)), _mm512_set1_ps(-INFINITY));
            const __mmask16 higher = _mm512_cmp_ps_mask(x, best, _CMP_GT_OQ); /* strictly: the first index stays */
            best = _mm512_mask_mov_ps(best, higher, x);
            where = _mm512_mask_mov_epi32(where, higher, _mm512_add_epi32(lane, _mm512_set1_epi32(v)));
        }
        float top = _mm512_reduce_max_ps(best);
        const __mmask16 at_top = _mm512_cmp_ps_mask(best, _mm512_set1_ps(top), _CMP_EQ_OQ);
        int token = _mm512_mask_reduce_min_epi32(at_top, where);
        for (; v < vocab; v++) {
            const float x = bf16 ? from_bf16(((const uint16_t *)logits)[base + v]) : ((const float *)logits)[base + v];
            if (v != skip && x > top) {
                top = x;
                token = v;
            }
        }
        if (top == -INFINITY) { /* every logit -inf (or the only finite one banned): as torch, token 0 */
            out[2 * r] = 0.0f;
            out[2 * r + 1] = -INFINITY;
            continue;
        }
        __m512 sum = _mm512_setzero_ps();
        const __m512 shift = _mm512_set1_ps(top);
        for (v = 0; v + 16 <= vocab; v += 16) {
            __m512 x = bf16 ? load_bf16((const uint16_t *)logits + base + v) : _mm512_loadu_ps((const float *)logits + base + v);
            if (skip >= v && skip < v + 16)
                x = _mm512_mask_mov_ps(x, (__mmask16)(1u << (skip - v)), _mm512_set1_ps(-INFINITY));
            sum = _mm512_add_ps(sum, exp_ps(_mm512_sub_ps(x, shift)));
        }
        float total = _mm512_reduce_add_ps(sum);
        for (; v < vocab; v++) {
            const float x = bf16 ? from_bf16(((const uint16_t *)logits)[base + v]) : ((const float *)logits)[base + v];
            if (v != skip)
                total += expf(x - top);
        }
        out[2 * r] = (float)token;
        out[2 * r + 1] = -logf(total);
    }
    return 0;
}
