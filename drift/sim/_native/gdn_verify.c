/* drift native CPU kernel: the GDN verify op (SGLang's NPU op semantics, docs/semantics.md
 * §5-§6) for float32 compute and round-to-nearest-even stores. It computes what
 * drift.sim.kernels.recurrent_gated_delta_rule's torch-op path computes. The rows of a state
 * evolve independently (row r needs only v[r] besides the shared q, k, decay and beta), so per
 * (layer, row, value head) the state is taken GR rows at a time: loaded once into a float32
 * scratch block that stays in L1 across the row's tokens; per token each row takes two passes
 * (decay and h.k; the rank-1 update and h.q), the GR rows interleaved so their dot products
 * overlap, and the rows after the token are rounded to the scratch's dtype and streamed out
 * (non-temporal stores, a cache line at a time where AVX-512 is there).
 * Built and loaded by drift/sim/native.py; no torch or Python headers.
 *
 * Work items are w = (l * B + b) * HV + hv; drift_rgdr splits [0, L*B*HV) over OpenMP threads.
 * States are [V][K] blocks (row v holds K contiguous elements), HV blocks per state block:
 * rec   : committed states, element (l, slot, hv, v, k) at l*rl + slot*rs + (hv*V + v)*K + k;
 * inter : scratch blocks by flat index i, element (l, i, hv, v, k) at l*il + i*is + (hv*V + v)*K + k;
 * sdt / idt: element type of rec / inter, 0 = float32, 1 = bfloat16;
 * start : int64 [B], the block a row starts from: a slot of rec when from_rec[b], else a flat
 *         scratch index; dst: int64 [B, S], the scratch block receiving the state after token t
 *         (negative: not stored -- a row verifying fewer tokens, or vLLM's NULL block);
 * q, k  : float32 dense [L, B, S, HV, K]; v, out: float32 dense [L, B, S, HV, V];
 * dec, beta: float32 dense [L, B, S, HV] (dec = exp(g), beta = sigmoid(b): computed by the caller);
 * work  : float32 scratch of 2*K*V floats per thread (min(GR, V) rows and their staged copy).
 */
#include <stdint.h>
#include <math.h>
#include <string.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif
#ifdef _OPENMP
#include <omp.h>
#endif

static inline float bf16_load(uint16_t b) {
    uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* float32 -> bfloat16, round to nearest even; every NaN -> 0xFFFF, the bits torch's
 * vectorised CPU cast gives (c10's scalar cast gives 0x7FC0). Not the dummy slot's
 * 0x7FC0 fill either, so a stray copy of a padded row into it changes its bits. */
static inline uint16_t bf16_store(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    uint32_t r = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
    return ((u & 0x7FFFFFFFu) > 0x7F800000u) ? (uint16_t)0xFFFFu : (uint16_t)r;
}

/* Copy a finished state to the scratch with non-temporal stores where the CPU has them:
 * the scratch is written once per step and not read until the update, so bypassing the
 * cache saves the read-for-ownership of every line (about half the scratch traffic). */
static void stream_out(char *dst, const void *src, size_t nbytes) {
#if defined(__SSE2__)
    if (((uintptr_t)dst & 15) == 0 && (nbytes & 15) == 0) {
        const __m128i *s = (const __m128i *)src;
        __m128i *d = (__m128i *)dst;
        for (size_t e = 0; e < nbytes / 16; ++e) _mm_stream_si128(d + e, _mm_loadu_si128(s + e));
        return;
    }
#endif
    memcpy(dst, src, nbytes);
}

int drift_native_abi(void) { return 7; }

static void load_block(float *h, const void *base, int dt, int64_t off, int64_t n) {
    if (dt == 1) {
        const uint16_t *s = (const uint16_t *)base + off;
        for (int64_t e = 0; e < n; ++e) h[e] = bf16_load(s[e]);
    } else {
        memcpy(h, (const float *)base + off, (size_t)n * sizeof(float));
    }
}

/* Lane-split accumulation: NL independent partial sums (lane j takes elements j, j + NL, ..)
 * added in a fixed order at the end. Deterministic, and written so the compiler vectorises it
 * without -ffast-math (a single running sum is a dependency chain it may not reorder). */
#define NL 16

/* h_r <- d * h_r; returns h_r . k (one state row of K elements). */
static inline float decay_dot(float *restrict hr, const float *restrict kt, float d, int64_t K) {
    float acc[NL] = {0.0f};
    int64_t c = 0;
    for (; c + NL <= K; c += NL)
        for (int j = 0; j < NL; ++j) {
            const float x = hr[c + j] * d;
            hr[c + j] = x;
            acc[j] += x * kt[c + j];
        }
    float s = 0.0f;
    for (int j = 0; j < NL; ++j) s += acc[j];
    for (; c < K; ++c) {
        const float x = hr[c] * d;
        hr[c] = x;
        s += x * kt[c];
    }
    return s;
}

/* h_r <- h_r + u k; returns h_r . q. */
static inline float axpy_dot(float *restrict hr, const float *restrict kt, const float *restrict qt, float u,
                             int64_t K) {
    float acc[NL] = {0.0f};
    int64_t c = 0;
    for (; c + NL <= K; c += NL)
        for (int j = 0; j < NL; ++j) {
            const float x = hr[c + j] + u * kt[c + j];
            hr[c + j] = x;
            acc[j] += x * qt[c + j];
        }
    float s = 0.0f;
    for (int j = 0; j < NL; ++j) s += acc[j];
    for (; c < K; ++c) {
        const float x = hr[c] + u * kt[c];
        hr[c] = x;
        s += x * qt[c];
    }
    return s;
}

/* The lane sums of a dot, added in lane order from 0: what decay_dot / axpy_dot return. */
static inline float lane_sum(const float *acc) {
    float s = 0.0f;
    for (int j = 0; j < NL; ++j) s += acc[j];
    return s;
}

#define GR 16 /* state rows advanced together: independent dots the CPU overlaps */

#if defined(__AVX512F__)
#include <immintrin.h>
/* decay_dot / axpy_dot on GR rows (K a multiple of NL = 16 lanes = one zmm): the same operations
 * on the same lanes (multiply and add, never fused: the build contracts nothing), so the same
 * bits; lane sums via lane_sum. */
static inline void decay_dot_rows(float *restrict h, int64_t K, const float *restrict kt, float d, float *restrict s) {
    const __m512 dv = _mm512_set1_ps(d);
    float acc[GR][NL] __attribute__((aligned(64)));
    for (int g = 0; g < GR; ++g) {
        float *restrict hr = h + g * K;
        __m512 a = _mm512_setzero_ps();
        for (int64_t c = 0; c < K; c += NL) {
            const __m512 x = _mm512_mul_ps(_mm512_loadu_ps(hr + c), dv);
            _mm512_storeu_ps(hr + c, x);
            a = _mm512_add_ps(a, _mm512_mul_ps(x, _mm512_loadu_ps(kt + c)));
        }
        _mm512_store_ps(acc[g], a);
    }
    for (int g = 0; g < GR; ++g) s[g] = lane_sum(acc[g]);
}

static inline void axpy_dot_rows(float *restrict h, int64_t K, const float *restrict kt, const float *restrict qt,
                                 const float *restrict u, float *restrict s) {
    float acc[GR][NL] __attribute__((aligned(64)));
    for (int g = 0; g < GR; ++g) {
        float *restrict hr = h + g * K;
        const __m512 uv = _mm512_set1_ps(u[g]);
        __m512 a = _mm512_setzero_ps();
        for (int64_t c = 0; c < K; c += NL) {
            const __m512 x = _mm512_add_ps(_mm512_loadu_ps(hr + c), _mm512_mul_ps(uv, _mm512_loadu_ps(kt + c)));
            _mm512_storeu_ps(hr + c, x);
            a = _mm512_add_ps(a, _mm512_mul_ps(x, _mm512_loadu_ps(qt + c)));
        }
        _mm512_store_ps(acc[g], a);
    }
    for (int g = 0; g < GR; ++g) s[g] = lane_sum(acc[g]);
}
#define ROWS_FAST(K) ((K) % NL == 0)
#else
static inline void decay_dot_rows(float *restrict h, int64_t K, const float *restrict kt, float d, float *restrict s) {
    for (int g = 0; g < GR; ++g) s[g] = decay_dot(h + g * K, kt, d, K);
}
static inline void axpy_dot_rows(float *restrict h, int64_t K, const float *restrict kt, const float *restrict qt,
                                 const float *restrict u, float *restrict s) {
    for (int g = 0; g < GR; ++g) s[g] = axpy_dot(h + g * K, kt, qt, u[g], K);
}
#define ROWS_FAST(K) 0
#endif

/* n float32 values of h stored to dst in the scratch's dtype (idt 1: bfloat16, round to nearest
 * even as bf16_store; 0: float32), with non-temporal stores where the CPU has them. */
static void store_rows(char *dst, int idt, const float *restrict h, void *restrict stage, int64_t n) {
#if defined(__AVX512F__)
    if (idt == 1 && ((uintptr_t)dst & 63) == 0 && n % 32 == 0) {
        const __m512i one = _mm512_set1_epi32(1), half = _mm512_set1_epi32(0x7FFF);
        const __m512i abs = _mm512_set1_epi32(0x7FFFFFFF), inf = _mm512_set1_epi32(0x7F800000);
        const __m512i nan = _mm512_set1_epi32(0xFFFF);
        for (int64_t e = 0; e < n; e += 32) {
            __m256i half16[2];
            for (int j = 0; j < 2; ++j) {
                const __m512i u = _mm512_castps_si512(_mm512_loadu_ps(h + e + 16 * j));
                const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), one);
                __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, half), odd), 16);
                const __mmask16 isnan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, abs), inf);
                r = _mm512_mask_mov_epi32(r, isnan, nan);
                half16[j] = _mm512_cvtepi32_epi16(r);
            }
            const __m512i line = _mm512_inserti64x4(_mm512_castsi256_si512(half16[0]), half16[1], 1);
            _mm512_stream_si512((__m512i *)(dst + 2 * e), line);
        }
        return;
    }
#endif
    if (idt == 1) {
        uint16_t *restrict s16 = (uint16_t *)stage;
        for (int64_t e = 0; e < n; ++e) s16[e] = bf16_store(h[e]);
        stream_out(dst, stage, (size_t)n * sizeof(uint16_t));
    } else {
        stream_out(dst, h, (size_t)n * sizeof(float));
    }
}

static void rgdr_items(int64_t w0, int64_t w1, int64_t B, int64_t S, int64_t HV, int64_t K, int64_t V,
                       const void *rec, int sdt, int64_t rl, int64_t rs, void *inter, int idt, int64_t il,
                       int64_t is, const int64_t *start, const uint8_t *from_rec, const int64_t *dst,
                       const float *q, const float *k, const float *v, const float *dec, const float *beta,
                       float *out, float *work) {
    float *restrict h = work; /* GR rows of the running state, float32 */
    void *restrict stage = work + (V < GR ? V : GR) * K; /* those rows in the scratch's dtype */
    const size_t esize = idt == 1 ? sizeof(uint16_t) : sizeof(float);
    const int64_t KV = K * V;
    const int fast = ROWS_FAST(K);
    for (int64_t w = w0; w < w1; ++w) {
        const int64_t hv = w % HV, b = (w / HV) % B, l = w / (HV * B);
        const int64_t tok0 = ((l * B + b) * S) * HV + hv;
        const void *sbase = from_rec[b] ? rec : inter;
        const int sd = from_rec[b] ? sdt : idt;
        const int64_t soff = from_rec[b] ? l * rl + start[b] * rs + hv * KV : l * il + start[b] * is + hv * KV;
        for (int64_t r0 = 0; r0 < V; r0 += GR) {
            const int64_t nr = V - r0 < GR ? V - r0 : GR;
            load_block(h, sbase, sd, soff + r0 * K, nr * K);
#if defined(__SSE2__)
            {   /* the next group's source rows, while this one computes */
                const int64_t nx = r0 + GR < V ? soff + (r0 + GR) * K : -1;
                if (nx >= 0) {
                    const char *p = (const char *)sbase + nx * (sd == 1 ? 2 : 4);
                    const int64_t nb = (V - r0 - GR < GR ? V - r0 - GR : GR) * K * (sd == 1 ? 2 : 4);
                    for (int64_t e = 0; e < nb; e += 64) _mm_prefetch(p + e, _MM_HINT_T0);
                }
            }
#endif
            for (int64_t t = 0; t < S; ++t) {
                const int64_t tok = tok0 + t * HV;
                const float *restrict qt = q + tok * K, *restrict kt = k + tok * K;
                const float *restrict vt = v + tok * V + r0;
                float *restrict ot = out + tok * V + r0;
                const float d = dec[tok], bt = beta[tok];
                if (fast && nr == GR) {
                    float s[GR], u[GR];
                    decay_dot_rows(h, K, kt, d, s);
                    for (int g = 0; g < GR; ++g) u[g] = (vt[g] - s[g]) * bt;
                    axpy_dot_rows(h, K, kt, qt, u, ot);
                } else {
                    for (int64_t g = 0; g < nr; ++g) {
                        float *restrict hr = h + g * K;
                        const float u = (vt[g] - decay_dot(hr, kt, d, K)) * bt;
                        ot[g] = axpy_dot(hr, kt, qt, u, K);
                    }
                }
                if (dst[b * S + t] >= 0) { /* a negative index: this token's state is not stored */
                    const int64_t to = l * il + dst[b * S + t] * is + hv * KV + r0 * K;
                    store_rows((char *)inter + to * (int64_t)esize, idt, h, stage, nr * K);
                }
            }
        }
    }
#if defined(__SSE2__)
    _mm_sfence(); /* non-temporal stores visible before the caller goes on */
#endif
}

/* Items [0, L*B*HV) split statically over nthreads OpenMP threads (one when built without
 * OpenMP); work holds nthreads scratch blocks of 2*K*V floats. */
void drift_rgdr(int64_t L, int64_t B, int64_t S, int64_t HV, int64_t K, int64_t V, int nthreads,
                const void *rec, int sdt, int64_t rl, int64_t rs, void *inter, int idt, int64_t il, int64_t is,
                const int64_t *start, const uint8_t *from_rec, const int64_t *dst, const float *q,
                const float *k, const float *v, const float *dec, const float *beta, float *out, float *work) {
    const int64_t items = L * B * HV;
#ifdef _OPENMP
    if (nthreads > 1) {
#pragma omp parallel num_threads(nthreads)
        {
            const int64_t tid = omp_get_thread_num(), nt = omp_get_num_threads();
            rgdr_items(items * tid / nt, items * (tid + 1) / nt, B, S, HV, K, V, rec, sdt, rl, rs, inter, idt,
                       il, is, start, from_rec, dst, q, k, v, dec, beta, out, work + tid * (2 * K * V));
        }
        return;
    }
#endif
    (void)nthreads;
    rgdr_items(0, items, B, S, HV, K, V, rec, sdt, rl, rs, inter, idt, il, is, start, from_rec, dst, q, k, v,
               dec, beta, out, work);
}

/* The float64 twins of decay_dot / axpy_dot; axpy_dot64 also adds ||h_r||^2 to *n2. */
static inline double decay_dot64(double *restrict hr, const double *restrict kt, double d, int64_t K) {
    double acc[NL] = {0.0};
    int64_t c = 0;
    for (; c + NL <= K; c += NL)
        for (int j = 0; j < NL; ++j) {
            const double x = hr[c + j] * d;
            hr[c + j] = x;
            acc[j] += x * kt[c + j];
        }
    double s = 0.0;
    for (int j = 0; j < NL; ++j) s += acc[j];
    for (; c < K; ++c) {
        const double x = hr[c] * d;
        hr[c] = x;
        s += x * kt[c];
    }
    return s;
}

static inline double axpy_dot64(double *restrict hr, const double *restrict kt, const double *restrict qt, double u,
                                int64_t K, double *n2) {
    double acc[NL] = {0.0}, sq[NL] = {0.0};
    int64_t c = 0;
    for (; c + NL <= K; c += NL)
        for (int j = 0; j < NL; ++j) {
            const double x = hr[c + j] + u * kt[c + j];
            hr[c + j] = x;
            acc[j] += x * qt[c + j];
            sq[j] += x * x;
        }
    double s = 0.0, s2 = 0.0;
    for (int j = 0; j < NL; ++j) {
        s += acc[j];
        s2 += sq[j];
    }
    for (; c < K; ++c) {
        const double x = hr[c] + u * kt[c];
        hr[c] = x;
        s += x * qt[c];
        s2 += x * x;
    }
    *n2 += s2;
    return s;
}

#define GR64 8 /* float64 state rows advanced together */

#if defined(__AVX512F__)
/* decay_dot64 / axpy_dot64 on GR64 rows (K a multiple of NL = 16 lanes = two zmm of doubles): the
 * same multiplies and adds on the same lanes, never fused, lane sums in lane order, so the same
 * bits; the rows' independent dependency chains overlap. axpy_dot64_rows returns each row's
 * ||h_r||^2 in s2 (the caller adds them to the item's norm in row order, as axpy_dot64 does). */
static inline void decay_dot64_rows(double *restrict h, int64_t K, const double *restrict kt, double d,
                                    double *restrict s) {
    const __m512d dv = _mm512_set1_pd(d);
    double acc[GR64][NL] __attribute__((aligned(64)));
    for (int g = 0; g < GR64; ++g) {
        double *restrict hr = h + g * K;
        __m512d a0 = _mm512_setzero_pd(), a1 = _mm512_setzero_pd();
        for (int64_t c = 0; c < K; c += NL) {
            const __m512d x0 = _mm512_mul_pd(_mm512_loadu_pd(hr + c), dv);
            const __m512d x1 = _mm512_mul_pd(_mm512_loadu_pd(hr + c + 8), dv);
            _mm512_storeu_pd(hr + c, x0);
            _mm512_storeu_pd(hr + c + 8, x1);
            a0 = _mm512_add_pd(a0, _mm512_mul_pd(x0, _mm512_loadu_pd(kt + c)));
            a1 = _mm512_add_pd(a1, _mm512_mul_pd(x1, _mm512_loadu_pd(kt + c + 8)));
        }
        _mm512_store_pd(acc[g], a0);
        _mm512_store_pd(acc[g] + 8, a1);
    }
    for (int g = 0; g < GR64; ++g) {
        double t = 0.0;
        for (int j = 0; j < NL; ++j) t += acc[g][j];
        s[g] = t;
    }
}

static inline void axpy_dot64_rows(double *restrict h, int64_t K, const double *restrict kt,
                                   const double *restrict qt, const double *restrict u, double *restrict s,
                                   double *restrict s2) {
    double acc[GR64][NL] __attribute__((aligned(64))), sq[GR64][NL] __attribute__((aligned(64)));
    for (int g = 0; g < GR64; ++g) {
        double *restrict hr = h + g * K;
        const __m512d uv = _mm512_set1_pd(u[g]);
        __m512d a0 = _mm512_setzero_pd(), a1 = _mm512_setzero_pd();
        __m512d q0 = _mm512_setzero_pd(), q1 = _mm512_setzero_pd();
        for (int64_t c = 0; c < K; c += NL) {
            const __m512d x0 = _mm512_add_pd(_mm512_loadu_pd(hr + c), _mm512_mul_pd(uv, _mm512_loadu_pd(kt + c)));
            const __m512d x1 = _mm512_add_pd(_mm512_loadu_pd(hr + c + 8),
                                             _mm512_mul_pd(uv, _mm512_loadu_pd(kt + c + 8)));
            _mm512_storeu_pd(hr + c, x0);
            _mm512_storeu_pd(hr + c + 8, x1);
            a0 = _mm512_add_pd(a0, _mm512_mul_pd(x0, _mm512_loadu_pd(qt + c)));
            a1 = _mm512_add_pd(a1, _mm512_mul_pd(x1, _mm512_loadu_pd(qt + c + 8)));
            q0 = _mm512_add_pd(q0, _mm512_mul_pd(x0, x0));
            q1 = _mm512_add_pd(q1, _mm512_mul_pd(x1, x1));
        }
        _mm512_store_pd(acc[g], a0);
        _mm512_store_pd(acc[g] + 8, a1);
        _mm512_store_pd(sq[g], q0);
        _mm512_store_pd(sq[g] + 8, q1);
    }
    for (int g = 0; g < GR64; ++g) {
        double t = 0.0, t2 = 0.0;
        for (int j = 0; j < NL; ++j) {
            t += acc[g][j];
            t2 += sq[g][j];
        }
        s[g] = t;
        s2[g] = t2;
    }
}
#define ROWS64_FAST(K) ((K) % NL == 0)
#else
static inline void decay_dot64_rows(double *restrict h, int64_t K, const double *restrict kt, double d,
                                    double *restrict s) {
    (void)h, (void)K, (void)kt, (void)d, (void)s;
}
static inline void axpy_dot64_rows(double *restrict h, int64_t K, const double *restrict kt,
                                   const double *restrict qt, const double *restrict u, double *restrict s,
                                   double *restrict s2) {
    (void)h, (void)K, (void)kt, (void)qt, (void)u, (void)s, (void)s2;
}
#define ROWS64_FAST(K) 0
#endif

/* The float64 truth's sequential decode (drift.sim.kernels.gdn_decode with float64 state and
 * compute): per item w = (l * R + r) * HV + hv the [V][K] block of state (dense [L, R, HV, V, K],
 * updated in place) runs all D tokens, those past ntok[r] as identities (decay 1, beta 0), as the
 * torch path does. q, k [L, R, D, HV, K]; v, out [L, R, D, HV, V]; dec, beta, norms [L, R, D, HV]:
 * dense float64; norms[tok] = ||S||_F^2 after token t. ncap captures: cap_steps[c * R + r] is the
 * token after which row r's state is copied into cap_out[c] (dense [L, R, HV, V, K]; -1: none). */
static void decode_items(int64_t w0, int64_t w1, int64_t R, int64_t D, int64_t HV, int64_t K, int64_t V,
                         double *state, const int64_t *ntok, const double *q, const double *k, const double *v,
                         const double *dec, const double *beta, double *out, double *norms, int64_t ncap,
                         const int64_t *cap_steps, double *const *cap_out) {
    const int64_t KV = K * V;
    for (int64_t w = w0; w < w1; ++w) {
        const int64_t hv = w % HV, r = (w / HV) % R, l = w / (HV * R);
        double *restrict S = state + w * KV;
        double n2[D]; /* per token, ||S||_F^2 summed over the rows in row order */
        for (int64_t t = 0; t < D; ++t) n2[t] = 0.0;
        /* The rows evolve independently: each group of rows (GR64 at a time, then one by one) runs
         * through all D tokens while it stays in L1; every row sees the same operations in the same
         * order as token by token over the whole state. */
        for (int64_t row = 0; row < V;) {
            const int64_t nr = ROWS64_FAST(K) && row + GR64 <= V ? GR64 : 1;
            double *restrict Sg = S + row * K;
            for (int64_t t = 0; t < D; ++t) {
                const int64_t tok = ((l * R + r) * D + t) * HV + hv;
                const double *restrict qt = q + tok * K, *restrict kt = k + tok * K;
                const double *restrict vt = v + tok * V + row;
                const int active = t < ntok[r];
                const double d = active ? dec[tok] : 1.0, bt = active ? beta[tok] : 0.0;
                if (nr == GR64) {
                    double sd[GR64], u[GR64], so[GR64], s2[GR64];
                    decay_dot64_rows(Sg, K, kt, d, sd);
                    for (int g = 0; g < GR64; ++g) u[g] = (vt[g] - sd[g]) * bt;
                    axpy_dot64_rows(Sg, K, kt, qt, u, so, s2);
                    for (int g = 0; g < GR64; ++g) {
                        out[tok * V + row + g] = so[g];
                        n2[t] += s2[g];
                    }
                } else {
                    const double u = (vt[0] - decay_dot64(Sg, kt, d, K)) * bt;
                    out[tok * V + row] = axpy_dot64(Sg, kt, qt, u, K, &n2[t]);
                }
                for (int64_t c = 0; c < ncap; ++c)
                    if (cap_steps[c * R + r] == t)
                        memcpy(cap_out[c] + w * KV + row * K, Sg, (size_t)(nr * K) * sizeof(double));
            }
            row += nr;
        }
        for (int64_t t = 0; t < D; ++t) norms[((l * R + r) * D + t) * HV + hv] = n2[t];
    }
}

/* n steps of drift_decode_f64 at once (the comparison's batch of steps): step j's arrays are those
 * drift_decode_f64 takes, each at j times its per-step size (ntok at j * R; q, k at j * L R D HV K;
 * v, out at j * L R D HV V; dec, beta, norms at j * L R D HV). Each item runs its n steps in order
 * while its [V][K] block stays in cache: the same arithmetic, in the same order, as n calls.
 * states_out (dense [n, L, R, HV, V, K], or NULL) receives the state after each step. The captures
 * are sorted by step: step j's are cap_first[j] .. cap_first[j + 1] - 1, each with R token indices
 * in cap_steps (cap_steps[c * R + r], as drift_decode_f64's) and its own output cap_out[c]. */
static void decode_steps_items(int64_t w0, int64_t w1, int64_t n, int64_t L, int64_t R, int64_t D, int64_t HV,
                               int64_t K, int64_t V, double *state, const int64_t *ntok, const double *q,
                               const double *k, const double *v, const double *dec, const double *beta, double *out,
                               double *norms, double *states_out, const int64_t *cap_first,
                               const int64_t *cap_steps, double *const *cap_out) {
    const int64_t KV = K * V, items = L * R * HV, sqk = L * R * D * HV * K, sv = L * R * D * HV * V,
                  sd = L * R * D * HV;
    for (int64_t w = w0; w < w1; ++w) {
        for (int64_t j = 0; j < n; ++j) {
            decode_items(w, w + 1, R, D, HV, K, V, state, ntok + j * R, q + j * sqk, k + j * sqk, v + j * sv,
                         dec + j * sd, beta + j * sd, out + j * sv, norms + j * sd, cap_first[j + 1] - cap_first[j],
                         cap_steps + cap_first[j] * R, cap_out + cap_first[j]);
            if (states_out != NULL)
                memcpy(states_out + (j * items + w) * KV, state + w * KV, (size_t)KV * sizeof(double));
        }
    }
}

void drift_decode_f64_steps(int64_t n, int64_t L, int64_t R, int64_t D, int64_t HV, int64_t K, int64_t V,
                            int nthreads, double *state, const int64_t *ntok, const double *q, const double *k,
                            const double *v, const double *dec, const double *beta, double *out, double *norms,
                            double *states_out, const int64_t *cap_first, const int64_t *cap_steps,
                            double *const *cap_out) {
    const int64_t items = L * R * HV;
#ifdef _OPENMP
    if (nthreads > 1) {
#pragma omp parallel num_threads(nthreads)
        {
            const int64_t tid = omp_get_thread_num(), nt = omp_get_num_threads();
            decode_steps_items(items * tid / nt, items * (tid + 1) / nt, n, L, R, D, HV, K, V, state, ntok, q, k, v,
                               dec, beta, out, norms, states_out, cap_first, cap_steps, cap_out);
        }
        return;
    }
#endif
    (void)nthreads;
    decode_steps_items(0, items, n, L, R, D, HV, K, V, state, ntok, q, k, v, dec, beta, out, norms, states_out,
                       cap_first, cap_steps, cap_out);
}

/* One step: drift_decode_f64_steps with n = 1 (its captures all at that step). */
void drift_decode_f64(int64_t L, int64_t R, int64_t D, int64_t HV, int64_t K, int64_t V, int nthreads, double *state,
                      const int64_t *ntok, const double *q, const double *k, const double *v, const double *dec,
                      const double *beta, double *out, double *norms, int64_t ncap, const int64_t *cap_steps,
                      double *const *cap_out) {
    const int64_t cap_first[2] = {0, ncap};
    drift_decode_f64_steps(1, L, R, D, HV, K, V, nthreads, state, ntok, q, k, v, dec, beta, out, norms, NULL,
                           cap_first, cap_steps, cap_out);
}

/* ulp(x)^2 of the grid with p significant bits: x = m 2^e, m in [0.5, 1), ulp = 2^(e - p), built
 * from x's exponent bits (frexp's e = biased exponent - 1022 for normal x); 0 at 0, for subnormal
 * x (a negligible ulp) and for Inf / NaN (the finite flag reports those). */
static inline int64_t bits64(double x) {
    int64_t i;
    memcpy(&i, &x, sizeof i);
    return i;
}

static inline double ulp2(double x, int p) {
    const int64_t biased = (bits64(x) >> 52) & 0x7FF;
    const int64_t f = 2 * (biased - 1022 - p) + 1023; /* biased exponent of 2^(2 (e - p)) */
    const int64_t keep = -(int64_t)((biased != 0) & (biased != 0x7FF) & (f > 0)); /* all ones or 0 */
    const int64_t r = (f << 52) & keep; /* bitwise select: the loop stays vectorisable */
    double out;
    memcpy(&out, &r, sizeof out);
    return out;
}

/* One state row of K elements into the per-column sums (separate restrict parameters, so the
 * compiler knows the sums do not alias and vectorises over the columns); each xs[c] is replaced by
 * its ulp^2 on the run's grid, which the caller sums per row. */
static void metric_row(int64_t K, double *restrict xs, const double *restrict y, double *restrict ae,
                       double *restrict ar, double *restrict ax, double *restrict cw, double *restrict a4,
                       double *restrict ab, double *restrict an, int rp) {
    for (int64_t c = 0; c < K; ++c) {
        const double x = xs[c], d = x - y[c];
        ae[c] += d * d;
        ar[c] += y[c] * y[c];
        ax[c] += x * x;
        const double q = ulp2(x, rp);
        cw[c] += q;
        a4[c] += q * q;
        ab[c] += ulp2(y[c], 8);
        an[c] += (double)(((bits64(x) >> 52) & 0x7FF) == 0x7FF); /* Inf or NaN: all exponent bits set */
        xs[c] = q;
    }
}

/* Per item w = (l * R + r) * HV + hv, the comparison of a run's committed state ([V][K] blocks of
 * run: element type rdt (0 float32, 1 bfloat16), dense [L, R, HV, V, K]) with the truth's (truth:
 * dense float64 [L, R, HV, V, K]): m[w * 8 + j] for j = err2, ref2, run2, ulp2_run, ulp4_run (ulp on
 * the run dtype's grid, rp significant bits), ulp2_bf16 of the truth, ulp2_rows2 (the sum over the V
 * rows of each row's ulp^2 sum, squared), finite (1 or 0); col[w * K + c]
 * the run's ulp^2 summed over the V rows of key column c. Sums run per key column over the rows
 * (independent lanes the compiler vectorises), then over the columns in order. */
static void metric_items(int64_t w0, int64_t w1, int64_t K, int64_t V, const void *run, int rdt, int rp,
                         const double *truth, double *m, double *col, double *acc) {
    const int64_t KV = K * V;
    double *restrict ae = acc, *restrict ar = acc + K, *restrict ax = acc + 2 * K, *restrict a4 = acc + 3 * K,
                     *restrict ab = acc + 4 * K, *restrict an = acc + 5 * K, *restrict xs = acc + 6 * K;
    for (int64_t w = w0; w < w1; ++w) {
        double *restrict cw = col + w * K;
        for (int64_t c = 0; c < 6 * K; ++c) acc[c] = 0.0;
        for (int64_t c = 0; c < K; ++c) cw[c] = 0.0;
        double rows2 = 0.0;
        for (int64_t row = 0; row < V; ++row) {
            const int64_t base = w * KV + row * K;
            const double *restrict y = truth + base;
            if (rdt == 1) {
                const uint16_t *restrict s16 = (const uint16_t *)run + base;
                for (int64_t c = 0; c < K; ++c) xs[c] = (double)bf16_load(s16[c]);
            } else {
                const float *restrict s32 = (const float *)run + base;
                for (int64_t c = 0; c < K; ++c) xs[c] = (double)s32[c];
            }
            metric_row(K, xs, y, ae, ar, ax, cw, a4, ab, an, rp);
            /* this row's ulp^2 (metric_row left it in xs), four lanes then in order: the row
             * concentration of the rounding energy */
            double r0 = 0.0, r1 = 0.0, r2 = 0.0, r3 = 0.0;
            int64_t c = 0;
            for (; c + 4 <= K; c += 4) {
                r0 += xs[c]; r1 += xs[c + 1]; r2 += xs[c + 2]; r3 += xs[c + 3];
            }
            for (; c < K; ++c) r0 += xs[c];
            const double rs = (r0 + r1) + (r2 + r3);
            rows2 += rs * rs;
        }
        double err2 = 0, ref2 = 0, run2 = 0, u2 = 0, u4 = 0, ub = 0, bad = 0;
        for (int64_t c = 0; c < K; ++c) {
            err2 += ae[c]; ref2 += ar[c]; run2 += ax[c]; u2 += cw[c]; u4 += a4[c]; ub += ab[c]; bad += an[c];
        }
        double *restrict mw = m + w * 8;
        mw[0] = err2; mw[1] = ref2; mw[2] = run2; mw[3] = u2; mw[4] = u4; mw[5] = ub; mw[6] = rows2;
        mw[7] = bad == 0.0;
    }
}

void drift_state_metrics(int64_t items, int64_t K, int64_t V, int nthreads, const void *run, int rdt, int rp,
                         const double *truth, double *m, double *col, double *acc) {
#ifdef _OPENMP
    if (nthreads > 1) {
#pragma omp parallel num_threads(nthreads)
        {
            const int64_t tid = omp_get_thread_num(), nt = omp_get_num_threads();
            metric_items(items * tid / nt, items * (tid + 1) / nt, K, V, run, rdt, rp, truth, m, col,
                         acc + tid * 7 * K);
        }
        return;
    }
#endif
    (void)nthreads;
    metric_items(0, items, K, V, run, rdt, rp, truth, m, col, acc);
}

/* The slot guard's question on the CPU (drift.simulate.SlotGuard): flags[s] = 1 where slot s's bytes
 * differ between now and before in any layer, else 0. Both dense [L, S, nbytes]: each slot's memory
 * in a layer is one run of nbytes. A slot stops being compared at its first difference. */
void drift_changed_slots(int64_t L, int64_t S, int64_t nbytes, const unsigned char *now,
                         const unsigned char *before, unsigned char *flags) {
    for (int64_t s = 0; s < S; ++s) {
        flags[s] = 0;
        for (int64_t l = 0; l < L; ++l) {
            const int64_t off = (l * S + s) * nbytes;
            if (memcmp(now + off, before + off, (size_t)nbytes) != 0) {
                flags[s] = 1;
                break;
            }
        }
    }
}

/* n elements of a strided run (element stride st) of element type dt (0 float32, 1 bfloat16, 2 float64)
 * into dst as doubles, exactly. */
static void load_run(double *restrict dst, const char *base, int dt, int64_t off, int64_t st, int64_t n) {
    if (dt == 0) {
        const float *p = (const float *)base + off;
        for (int64_t i = 0; i < n; ++i) dst[i] = (double)p[i * st];
    } else if (dt == 1) {
        const uint16_t *p = (const uint16_t *)base + off;
        for (int64_t i = 0; i < n; ++i) dst[i] = (double)bf16_load(p[i * st]);
    } else {
        const double *p = (const double *)base + off;
        for (int64_t i = 0; i < n; ++i) dst[i] = p[i * st];
    }
}

/* The verify conv's taps (drift.sim.kernels.conv_mix): for each layer l, row n, token t and channel c,
 * acc = s[t] w[0] + s[t+1] w[1] + ... + s[t+Kc-1] w[Kc-1], summed left to right in float64, each
 * product and each sum rounded on its own (-ffp-contract=off: the torch path's mul and add_, or its
 * addcmul_ whose products of narrow inputs are exact), where s is the row's Kc-1 window tokens then its
 * D tokens; vectorised over channels, which leaves each element's order as written. neg = -acc (exact),
 * for the caller's exp. window [L, N, Kc-1, C], x [L, N, D, C] and w [L, C, Kc] are read through their
 * element strides (ws, xs, wts) in their own dtypes; acc and neg are dense float64 [L, N, D, C].
 * scratch: (Kc-1+D+Kc) * C doubles (a row's tokens, a layer's taps, both channel-minor). */
void drift_conv_taps(int64_t L, int64_t N, int64_t D, int64_t Kc, int64_t C,
                     const char *win, int wdt, int64_t ws0, int64_t ws1, int64_t ws2, int64_t ws3,
                     const char *x, int xdt, int64_t xs0, int64_t xs1, int64_t xs2, int64_t xs3,
                     const char *w, int wtdt, int64_t wt0, int64_t wt1, int64_t wt2,
                     double *acc, double *neg, double *scratch) {
    const int64_t Km1 = Kc - 1;
    double *seq = scratch, *tap = scratch + (Km1 + D) * C;  /* seq[j * C + c], tap[m * C + c] */
    for (int64_t l = 0; l < L; ++l) {
        for (int64_t m = 0; m < Kc; ++m) load_run(tap + m * C, w, wtdt, l * wt0 + m * wt2, wt1, C);
        for (int64_t n = 0; n < N; ++n) {
            for (int64_t j = 0; j < Km1; ++j) load_run(seq + j * C, win, wdt, l * ws0 + n * ws1 + j * ws2, ws3, C);
            for (int64_t t = 0; t < D; ++t) load_run(seq + (Km1 + t) * C, x, xdt, l * xs0 + n * xs1 + t * xs2, xs3, C);
            for (int64_t t = 0; t < D; ++t) {
                double *restrict a = acc + ((l * N + n) * D + t) * C;
                double *restrict g = neg + ((l * N + n) * D + t) * C;
                const double *s0 = seq + t * C;
                for (int64_t c = 0; c < C; ++c) a[c] = s0[c] * tap[c];
                for (int64_t m = 1; m < Kc; ++m) {
                    const double *sm = seq + (t + m) * C, *tm = tap + m * C;
                    for (int64_t c = 0; c < C; ++c) {
                        const double p = sm[c] * tm[c];
                        a[c] = a[c] + p;
                    }
                }
                for (int64_t c = 0; c < C; ++c) g[c] = -a[c];
            }
        }
    }
}

/* The conv's SiLU and output rounding (drift.sim.kernels.conv_mix / quantize_mix) over n elements:
 * out = bf16(float32(acc / (1 + e))), e = exp(-acc) from the caller (torch's exp: its bits are the
 * figures'), each step rounded to nearest even as torch's ops round. Returns 1 where a result is NaN
 * (out then incomplete): torch's cast gives a NaN's bits by where the element falls in its vector loop,
 * so the caller rounds such a call with torch. */
int drift_conv_silu_bf16(int64_t n, const double *restrict acc, const double *restrict e, uint16_t *restrict out) {
    int nan = 0;
    for (int64_t i = 0; i < n; ++i) {
        const float f = (float)(acc[i] / (1.0 + e[i]));
        uint32_t u;
        memcpy(&u, &f, sizeof u);
        nan |= (u & 0x7FFFFFFFu) > 0x7F800000u;
        out[i] = (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
    }
    return nan;
}

/* drift.sim.kernels.store_state's stochastic rounding of n float32 values (their bits h, dense): out[i] the
 * bits of the float32 that holds element i's bf16, its low 16 bits zero (the caller's cast to bf16 is
 * torch's, exact but for a NaN, whose bits torch's cast chooses). Element i's noise is the low 16 bits of
 * kernels._hash32(offset + i, key) (k32 = key mod 2^32; every product and sum of that int64 arithmetic is
 * taken mod 2^32, which is what its masks keep), added to the magnitude bits, then truncated. */
void drift_stochastic_bf16_bits(int64_t n, int64_t offset, int64_t k32, const uint32_t *restrict h,
                                uint32_t *restrict out) {
    const uint32_t mix = (uint32_t)((uint64_t)(uint32_t)k32 * 0x632BE5ABull);
    for (int64_t i = 0; i < n; ++i) {
        uint32_t x = (uint32_t)(offset + i) + mix;
        x = ((x >> 16) ^ x) * 0x45D9F3Bu;
        x = ((x >> 16) ^ x) * 0x45D9F3Bu;
        x = (x >> 16) ^ x;
        out[i] = (h[i] + (x & 0xFFFFu)) & 0xFFFF0000u;
    }
}

int drift_native_openmp(void) {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}
