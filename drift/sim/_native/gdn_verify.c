/* drift native CPU kernel: the GDN verify op (SGLang's NPU op semantics, docs/semantics.md
 * §5-§6) for float32 compute and round-to-nearest-even stores. It computes what
 * drift.sim.kernels.recurrent_gated_delta_rule's torch-op path computes: per (layer, row, value
 * head) the state is loaded once into a float32 scratch block and kept there across the row's
 * tokens; per token each of its V rows takes one pass (decay, h.k, the rank-1 update, h.q) and
 * the state after the token is staged in the scratch's dtype and streamed out.
 * Built and loaded by drift/sim/native.py; no torch or Python headers.
 *
 * Work items are w = (l * B + b) * HV + hv; drift_rgdr splits [0, L*B*HV) over OpenMP threads.
 * States are [V][K] blocks (row v holds K contiguous elements), HV blocks per state block:
 * rec   : committed states, element (l, slot, hv, v, k) at l*rl + slot*rs + (hv*V + v)*K + k;
 * inter : scratch blocks by flat index i, element (l, i, hv, v, k) at l*il + i*is + (hv*V + v)*K + k;
 * sdt / idt: element type of rec / inter, 0 = float32, 1 = bfloat16;
 * start : int64 [B], the block a row starts from: a slot of rec when from_rec[b], else a flat
 *         scratch index; dst: int64 [B, S], the scratch block receiving the state after token t;
 * q, k  : float32 dense [L, B, S, HV, K]; v, out: float32 dense [L, B, S, HV, V];
 * dec, beta: float32 dense [L, B, S, HV] (dec = exp(g), beta = sigmoid(b): computed by the caller);
 * work  : float32 scratch of 2*K*V floats per thread.
 */
#include <stdint.h>
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

int drift_native_abi(void) { return 2; }

static void load_block(float *h, const void *base, int dt, int64_t off, int64_t n) {
    if (dt == 1) {
        const uint16_t *s = (const uint16_t *)base + off;
        for (int64_t e = 0; e < n; ++e) h[e] = bf16_load(s[e]);
    } else {
        memcpy(h, (const float *)base + off, (size_t)n * sizeof(float));
    }
}

static void rgdr_items(int64_t w0, int64_t w1, int64_t B, int64_t S, int64_t HV, int64_t K, int64_t V,
                       const void *rec, int sdt, int64_t rl, int64_t rs, void *inter, int idt, int64_t il,
                       int64_t is, const int64_t *start, const uint8_t *from_rec, const int64_t *dst,
                       const float *q, const float *k, const float *v, const float *dec, const float *beta,
                       float *out, float *work) {
    float *restrict h = work;
    void *restrict stage = work + K * V; /* the state after a token, in the scratch's dtype */
    const size_t esize = idt == 1 ? sizeof(uint16_t) : sizeof(float);
    const int64_t KV = K * V;
    for (int64_t w = w0; w < w1; ++w) {
        const int64_t hv = w % HV, b = (w / HV) % B, l = w / (HV * B);
        if (from_rec[b])
            load_block(h, rec, sdt, l * rl + start[b] * rs + hv * KV, KV);
        else
            load_block(h, inter, idt, l * il + start[b] * is + hv * KV, KV);
        for (int64_t t = 0; t < S; ++t) {
            const int64_t tok = ((l * B + b) * S + t) * HV + hv;
            const float *restrict qt = q + tok * K, *restrict kt = k + tok * K;
            const float *restrict vt = v + tok * V;
            float *restrict ot = out + tok * V;
            const float d = dec[tok], bt = beta[tok];
            for (int64_t r = 0; r < V; ++r) {
                float *restrict hr = h + r * K;
                float hk = 0.0f;
                for (int64_t c = 0; c < K; ++c) {
                    const float x = hr[c] * d;
                    hr[c] = x;
                    hk += x * kt[c];
                }
                const float u = (vt[r] - hk) * bt;
                float o = 0.0f;
                uint16_t *restrict s16 = (uint16_t *)stage + r * K;
                float *restrict s32 = (float *)stage + r * K;
                for (int64_t c = 0; c < K; ++c) {
                    const float x = hr[c] + u * kt[c];
                    hr[c] = x;
                    o += x * qt[c];
                    if (idt == 1)
                        s16[c] = bf16_store(x);
                    else
                        s32[c] = x;
                }
                ot[r] = o;
            }
            const int64_t to = l * il + dst[b * S + t] * is + hv * KV;
            stream_out((char *)inter + to * (int64_t)esize, stage, (size_t)KV * esize);
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

int drift_native_openmp(void) {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}
