/* drift native CPU kernel: GDN verify (NPU semantics) for float32 compute and
 * round-to-nearest-even stores. It computes what drift.kernels.gdn_verify's torch-op
 * path computes, per head with the state kept in a float32 scratch buffer across the
 * D verify tokens: two passes over the state per token instead of five tensor ops, then
 * one copy of the stored state (bf16: half its size) out to the scratch.
 * Built and loaded by drift/native.py; no torch or Python headers.
 *
 * Heads are flattened b = (l * N + n) * HV + hv; drift_gdn_verify splits [0, B) over
 * OpenMP threads, each running gdn_heads on its range [b0, b1).
 * state : committed states, element (l, slot, hv, i, j) at
 *         l*ss_l + slot*ss_s + hv*ss_h + i*V + j (each head's [K, V] block dense);
 * inter : scratch, element (l, n, t, hv, i, j) at l*is_l + n*is_n + t*is_t + hv*is_h + i*V + j;
 * sdt / idt: element type of state / inter, 0 = float32, 1 = bfloat16;
 * q, k  : float32 dense [L, N, D, HV, K]; v, out: float32 dense [L, N, D, HV, V];
 * dec, beta: float32 dense [L, N, D, HV] (dec = exp(g), computed by the caller);
 * work  : float32 scratch of 2*K*V + 2*V elements per thread.
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

int drift_native_abi(void) { return 1; }

static void gdn_heads(int64_t b0, int64_t b1, int64_t N, int64_t D, int64_t HV, int64_t K,
                      int64_t V, const void *state, int sdt, const int64_t *slots, int64_t ss_l,
                      int64_t ss_s, int64_t ss_h, void *inter, int idt, int64_t is_l, int64_t is_n,
                      int64_t is_t, int64_t is_h, const float *q, const float *k, const float *v,
                      const float *dec, const float *beta, float *out, float *work) {
    float *restrict h = work;
    float *restrict acc = work + K * V;
    float *restrict u = acc + V;
    void *restrict stage = u + V; /* the state after a token, in the scratch's dtype */
    const size_t esize = idt == 1 ? sizeof(uint16_t) : sizeof(float);
    const int64_t KV = K * V;
    for (int64_t b = b0; b < b1; ++b) {
        const int64_t hv = b % HV, n = (b / HV) % N, l = b / (HV * N);
        const int64_t src = l * ss_l + slots[n] * ss_s + hv * ss_h;
        if (sdt == 1) {
            const uint16_t *restrict s = (const uint16_t *)state + src;
            for (int64_t e = 0; e < KV; ++e) h[e] = bf16_load(s[e]);
        } else {
            memcpy(h, (const float *)state + src, (size_t)KV * sizeof(float));
        }
        for (int64_t t = 0; t < D; ++t) {
            const int64_t tok = ((l * N + n) * D + t) * HV + hv;
            const float *restrict qt = q + tok * K, *restrict kt = k + tok * K;
            const float *restrict vt = v + tok * V;
            float *restrict ot = out + tok * V;
            const float d = dec[tok], bt = beta[tok];
            /* Pass 1: decay, and k^T h of the decayed state. */
            for (int64_t j = 0; j < V; ++j) acc[j] = 0.0f;
            for (int64_t i = 0; i < K; ++i) {
                float *restrict hi = h + i * V;
                const float ki = kt[i];
                for (int64_t j = 0; j < V; ++j) {
                    const float x = hi[j] * d;
                    hi[j] = x;
                    acc[j] += ki * x;
                }
            }
            for (int64_t j = 0; j < V; ++j) {
                u[j] = (vt[j] - acc[j]) * bt;
                acc[j] = 0.0f;
            }
            /* Pass 2: rank-1 update, q^T h, and the state after token t staged in the
             * scratch's dtype. */
            const int64_t dst = l * is_l + n * is_n + t * is_t + hv * is_h;
            for (int64_t i = 0; i < K; ++i) {
                float *restrict hi = h + i * V;
                const float ki = kt[i], qi = qt[i];
                uint16_t *restrict s16 = (uint16_t *)stage + i * V;
                float *restrict s32 = (float *)stage + i * V;
                for (int64_t j = 0; j < V; ++j) {
                    const float x = hi[j] + ki * u[j];
                    hi[j] = x;
                    acc[j] += qi * x;
                    if (idt == 1)
                        s16[j] = bf16_store(x);
                    else
                        s32[j] = x;
                }
            }
            for (int64_t j = 0; j < V; ++j) ot[j] = acc[j];
            stream_out((char *)inter + dst * (int64_t)esize, stage, (size_t)KV * esize);
        }
    }
#if defined(__SSE2__)
    _mm_sfence(); /* non-temporal stores visible before the caller goes on */
#endif
}

/* Heads [0, B) split statically over nthreads OpenMP threads (one when built without
 * OpenMP); work holds nthreads scratch blocks of 2*K*V + 2*V floats. */
void drift_gdn_verify(int64_t B, int nthreads, int64_t N, int64_t D, int64_t HV, int64_t K,
                      int64_t V, const void *state, int sdt, const int64_t *slots, int64_t ss_l,
                      int64_t ss_s, int64_t ss_h, void *inter, int idt, int64_t is_l, int64_t is_n,
                      int64_t is_t, int64_t is_h, const float *q, const float *k, const float *v,
                      const float *dec, const float *beta, float *out, float *work) {
#ifdef _OPENMP
    if (nthreads > 1) {
#pragma omp parallel num_threads(nthreads)
        {
            const int64_t tid = omp_get_thread_num(), nt = omp_get_num_threads();
            gdn_heads(B * tid / nt, B * (tid + 1) / nt, N, D, HV, K, V, state, sdt, slots, ss_l, ss_s,
                      ss_h, inter, idt, is_l, is_n, is_t, is_h, q, k, v, dec, beta, out,
                      work + tid * (2 * K * V + 2 * V));
        }
        return;
    }
#endif
    (void)nthreads;
    gdn_heads(0, B, N, D, HV, K, V, state, sdt, slots, ss_l, ss_s, ss_h, inter, idt, is_l, is_n,
              is_t, is_h, q, k, v, dec, beta, out, work);
}

int drift_native_openmp(void) {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}
