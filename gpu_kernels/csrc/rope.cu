// Rotary position embedding fused with the q/k/v split of the grouped projection's output.
//
// The grouped q/k/v LoRA op returns one packed row per token, qkv (M, (H + 2·G)·D) with
// M = B·S tokens, H query heads, G key/value heads and head size D (even). Hugging Face's
// attention then splits it, rotates q and k with six elementwise ops each (rotate_half's two
// slices, a negation and a concatenation, two products, a sum) and its backward re-runs them
// with full-size zero-filled slice gradients. Here one pass does it all:
//
//   forward   q[b,h,s,i] = x_q[i]·cos[s,i] + rot(x_q)[i]·sin[s,i]       rot(x)[i] = −x[i+D/2], i <  D/2
//             k likewise; v copied                                      rot(x)[i] =  x[i−D/2], i >= D/2
//   backward  dx[j] = dq[j]·cos[j] + (j < D/2 ?  dq[j+D/2]·sin[j+D/2] : −dq[j−D/2]·sin[j−D/2])
//             (rotᵀ applied to dq ⊙ sin), dk likewise, dv copied, all into one packed (M, (H+2G)·D)
//             buffer, which is what the grouped LoRA backward reads.
//
// q, k, v are written as (B, S, heads, D) rows, handed to attention as (B, heads, S, D) views.
// cos/sin (Bc, S, D) with Bc = 1 (broadcast, batch stride 0) or B; or, given positions pos (B·S)
// int64, one (P, D) table indexed by each token's position (packed rows, where positions restart
// at every sequence: one (S, D) table instead of a (B, S, D) copy per row). Math in fp32, one
// rounding.
//
// Per family (worker/engine/families.py): the tables may cover only the first R < D dims of a head
// (partial rotary, Phi-4-mini: the rest is copied), and q and k may first go through a per-head
// RMSNorm (Qwen3, Gemma 3: q/k norm between the projection and RoPE), in the same pass; its
// backward recomputes the norm's rstd from the saved input.

#include "common.cuh"

namespace {

// kV consecutive elements as fp32: one vector move when kV == 4 (the host checks alignment).
template <int kV, typename T>
__device__ __forceinline__ void load_v(const T* p, float (&v)[kV]) {
  if constexpr (kV == 4) {
    load4(p, v);
  } else {
#pragma unroll
    for (int j = 0; j < kV; ++j) v[j] = loraq_load(p, j);
  }
}
template <int kV, typename T>
__device__ __forceinline__ void store_v(T* p, const float (&v)[kV]) {
  if constexpr (kV == 4) {
    store4(p, v);
  } else {
#pragma unroll
    for (int j = 0; j < kV; ++j) loraq_store(p, j, v[j]);
  }
}

// cos and sin at i.. and i + D/2.. of one token's table row.
template <int kV, typename T>
__device__ __forceinline__ void load_angles(const T* c, const T* sn, int i, int half, float (&c0)[kV],
                                            float (&c1)[kV], float (&s0)[kV], float (&s1)[kV]) {
  load_v<kV>(c + i, c0);
  load_v<kV>(c + i + half, c1);
  load_v<kV>(sn + i, s0);
  load_v<kV>(sn + i + half, s1);
}

// The token's cos/sin row: its position's row of one table, or row (b, s) of per-row tables.
__device__ __forceinline__ int64_t angle_offset(const int64_t* __restrict__ pos, int64_t m, int64_t b, int64_t s,
                                                int64_t cs_b, int64_t cs_s) {
  return pos != nullptr ? pos[m] * cs_s : b * cs_b + s * cs_s;
}

// Per-head RMSNorm of q and k before the rotation (Qwen3, Gemma 3): (o + w) ⊙ x · rstd over a
// head's D elements, w (D,) one weight for all q heads, one for all k heads.
template <typename T>
struct HeadNorm {
  const T* qw;  // (D,) or null: no norm
  const T* kw;
  float eps, offset;
};

// Sum over the `width` consecutive lanes that hold one head (width a power of two <= 32, the
// groups aligned to it); every lane of the warp must call it.
__device__ __forceinline__ float group_sum(float v, int width) {
  for (int o = width >> 1; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// One block per token; each thread takes kV consecutive pairs of one head, so a warp's loads are
// consecutive (coalesced, 8- or 16-byte vectors when kV == 4) and the rotation needs no exchange
// between threads. A head of D elements with R of them rotating (R = D, or less: partial rotary,
// Phi-4-mini) has D/2 pair slots: slot i < R/2 is the rotated pair (i, i + R/2), slot i >= R/2 the
// copied pair (R + i', R + i' + (D − R)/2), i' = i − R/2. With kNorm the `groups` threads of a head
// reduce over it by warp shuffles: the loop runs the same number of times on every thread.
template <typename T, int kV, bool kNorm>
__global__ void rope_fwd_kernel(const T* __restrict__ qkv, const T* __restrict__ cos, const T* __restrict__ sin,
                                const int64_t* __restrict__ pos, int64_t cs_b, int64_t cs_s, T* __restrict__ q,
                                T* __restrict__ k, T* __restrict__ v, HeadNorm<T> norm,
                                int S, int H, int G, int D, int R) {
  const int64_t m = blockIdx.x;  // token b·S + s
  const int64_t b = m / S, s = m % S;
  const int half = D / 2, rh = R / 2, ph = (D - R) / 2, groups = half / kV;
  // v null: the v heads are neither read nor copied (the caller reads v in place from qkv)
  const int heads = H + 2 * G, work = (v != nullptr ? heads : H + G) * groups;
  const T* x = qkv + m * heads * D;
  const int64_t a = angle_offset(pos, m, b, s, cs_b, cs_s);
  const T *c = cos + a, *sn = sin + a;
  for (int base = 0; base < work; base += blockDim.x) {
    const int t = base + threadIdx.x;
    const bool active = t < work;
    const int h = active ? t / groups : 0, i = (t % groups) * kV;
    const bool rotary = i < rh;
    const int lo = rotary ? i : R + (i - rh), hi = rotary ? i + rh : R + (i - rh) + ph;  // the pair
    float x0[kV], x1[kV];
#pragma unroll
    for (int j = 0; j < kV; ++j) x0[j] = x1[j] = 0.f;
    if (active) {
      load_v<kV>(x + h * D + lo, x0);
      load_v<kV>(x + h * D + hi, x1);
    }
    if constexpr (kNorm) {
      float ss = 0.f;
#pragma unroll
      for (int j = 0; j < kV; ++j) ss += x0[j] * x0[j] + x1[j] * x1[j];
      const float rstd = rsqrtf(group_sum(ss, groups) / static_cast<float>(D) + norm.eps);
      if (active && h < H + G) {
        const T* w = h < H ? norm.qw : norm.kw;
        float w0[kV], w1[kV];
        load_v<kV>(w + lo, w0);
        load_v<kV>(w + hi, w1);
#pragma unroll
        for (int j = 0; j < kV; ++j) {
          x0[j] *= rstd * (norm.offset + w0[j]);
          x1[j] *= rstd * (norm.offset + w1[j]);
        }
      }
    }
    if (!active) continue;
    if (h >= H + G) {  // v: copied
      T* o = v + (m * G + (h - H - G)) * D;
      store_v<kV>(o + lo, x0);
      store_v<kV>(o + hi, x1);
      continue;
    }
    T* o = h < H ? q + (m * H + h) * D : k + (m * G + (h - H)) * D;
    if (rotary) {
      float c0[kV], c1[kV], s0[kV], s1[kV], o0[kV], o1[kV];
      load_angles<kV>(c, sn, i, rh, c0, c1, s0, s1);
#pragma unroll
      for (int j = 0; j < kV; ++j) {
        o0[j] = x0[j] * c0[j] - x1[j] * s0[j];
        o1[j] = x1[j] * c1[j] + x0[j] * s1[j];
      }
      store_v<kV>(o + lo, o0);
      store_v<kV>(o + hi, o1);
    } else {
      store_v<kV>(o + lo, x0);
      store_v<kV>(o + hi, x1);
    }
  }
}

// dq/dk/dv come from attention's backward as (B, heads, S, D) tensors with any strides but a
// unit last one: (b, h, s) strides are passed per tensor.
struct GradView {
  const void* p;
  int64_t sb, sh, ss;
};

// With kNorm, qkv is the forward's input (the pre-norm q/k): the rotation's gradient g is then
// taken through the norm, dx = rstd · (w'⊙g − x · rstd² · mean(w'⊙g⊙x)), w' = o + w, with rstd
// recomputed from x.
template <typename T, int kV, bool kNorm>
__global__ void rope_bwd_kernel(GradView dq, GradView dk, GradView dv, const T* __restrict__ cos,
                                const T* __restrict__ sin, const int64_t* __restrict__ pos, int64_t cs_b,
                                int64_t cs_s, const T* __restrict__ qkv, HeadNorm<T> norm, T* __restrict__ dqkv,
                                int S, int H, int G, int D, int R) {
  const int64_t m = blockIdx.x;
  const int64_t b = m / S, s = m % S;
  const int half = D / 2, rh = R / 2, ph = (D - R) / 2, groups = half / kV;
  const int heads = H + 2 * G, work = heads * groups;
  T* out = dqkv + m * heads * D;
  const int64_t a = angle_offset(pos, m, b, s, cs_b, cs_s);
  const T *c = cos + a, *sn = sin + a;
  for (int base = 0; base < work; base += blockDim.x) {
    const int t = base + threadIdx.x;
    const bool active = t < work;
    const int h = active ? t / groups : 0, i = (t % groups) * kV;
    const bool rotary = i < rh;
    const int lo = rotary ? i : R + (i - rh), hi = rotary ? i + rh : R + (i - rh) + ph;
    // pick the tensor by value (a runtime-chosen reference to a kernel parameter would put the
    // parameters in local memory)
    const bool is_q = h < H, is_k = !is_q && h < H + G;
    float d0[kV], d1[kV];
#pragma unroll
    for (int j = 0; j < kV; ++j) d0[j] = d1[j] = 0.f;
    if (active) {
      const int hh = is_q ? h : (is_k ? h - H : h - H - G);
      const void* src_base = is_q ? dq.p : (is_k ? dk.p : dv.p);
      const int64_t off = is_q ? b * dq.sb + hh * dq.sh + s * dq.ss
                               : (is_k ? b * dk.sb + hh * dk.sh + s * dk.ss : b * dv.sb + hh * dv.sh + s * dv.ss);
      const T* src = static_cast<const T*>(src_base) + off;
      float g0[kV], g1[kV];
      load_v<kV>(src + lo, g0);
      load_v<kV>(src + hi, g1);
      if (rotary && h < H + G) {
        float c0[kV], c1[kV], s0[kV], s1[kV];
        load_angles<kV>(c, sn, i, rh, c0, c1, s0, s1);
#pragma unroll
        for (int j = 0; j < kV; ++j) {
          d0[j] = g0[j] * c0[j] + g1[j] * s1[j];
          d1[j] = g1[j] * c1[j] - g0[j] * s0[j];
        }
      } else {
#pragma unroll
        for (int j = 0; j < kV; ++j) {
          d0[j] = g0[j];
          d1[j] = g1[j];
        }
      }
    }
    if constexpr (kNorm) {
      const bool normed = active && h < H + G;
      float x0[kV], x1[kV], w0[kV], w1[kV];
#pragma unroll
      for (int j = 0; j < kV; ++j) x0[j] = x1[j] = w0[j] = w1[j] = 0.f;
      if (normed) {
        const T* x = qkv + m * heads * D + h * D;
        const T* w = h < H ? norm.qw : norm.kw;
        load_v<kV>(x + lo, x0);
        load_v<kV>(x + hi, x1);
        load_v<kV>(w + lo, w0);
        load_v<kV>(w + hi, w1);
      }
      float ss = 0.f, dot = 0.f;
#pragma unroll
      for (int j = 0; j < kV; ++j) {
        w0[j] += norm.offset;
        w1[j] += norm.offset;
        ss += x0[j] * x0[j] + x1[j] * x1[j];
        dot += w0[j] * d0[j] * x0[j] + w1[j] * d1[j] * x1[j];
      }
      ss = group_sum(ss, groups);
      dot = group_sum(dot, groups);
      if (normed) {
        const float rstd = rsqrtf(ss / static_cast<float>(D) + norm.eps);
        const float cc = dot * rstd * rstd / static_cast<float>(D);
#pragma unroll
        for (int j = 0; j < kV; ++j) {
          d0[j] = rstd * (w0[j] * d0[j] - x0[j] * cc);
          d1[j] = rstd * (w1[j] * d1[j] - x1[j] * cc);
        }
      }
    }
    if (!active) continue;
    store_v<kV>(out + h * D + lo, d0);
    store_v<kV>(out + h * D + hi, d1);
  }
}


// Vector moves need every pair start aligned to 4 elements: R/2 and (D − R)/2 multiples of 4,
// 4-element-aligned strides and base pointers.
bool aligned4(const void* p, int elt) { return p == nullptr || reinterpret_cast<uintptr_t>(p) % (4 * elt) == 0; }
bool strides4(int64_t a, int64_t b, int64_t c) { return a % 4 == 0 && b % 4 == 0 && c % 4 == 0; }

// The norm's reduction runs over the D/2/kV threads of a head: a power of two, at most a warp.
bool norm_fits(int D, int kV) {
  const int groups = D / 2 / kV;
  return groups >= 1 && groups <= 32 && (groups & (groups - 1)) == 0;
}

template <typename T, int kV, bool kNorm>
void fwd(const T* x, const T* c, const T* sn, const int64_t* pos, int64_t cs_b, int64_t cs_s, T* q, T* k, T* v,
         const HeadNorm<T>& norm, int64_t B, int S, int H, int G, int D, int R, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(B * S));
  const int heads = v != nullptr ? H + 2 * G : H + G;
  rope_fwd_kernel<T, kV, kNorm><<<grid, loraq_threads_for(heads * D / (2 * kV), 512), 0, stream>>>(
      x, c, sn, pos, cs_b, cs_s, q, k, v, norm, S, H, G, D, R);
}

template <typename T>
int launch_fwd(const void* qkv, const void* cos, const void* sin, const int64_t* pos, int64_t cs_b, int64_t cs_s,
               void* q, void* k, void* v, const HeadNorm<T>& norm, int64_t B, int S, int H, int G, int D, int R,
               cudaStream_t stream) {
  const int elt = sizeof(T);
  const bool vec = (R / 2) % 4 == 0 && ((D - R) / 2) % 4 == 0 && strides4(cs_b, cs_s, 0) && aligned4(qkv, elt) &&
                   aligned4(cos, elt) && aligned4(sin, elt) && aligned4(q, elt) && aligned4(k, elt) &&
                   aligned4(v, elt) && aligned4(norm.qw, elt) && aligned4(norm.kw, elt);
  const bool with_norm = norm.qw != nullptr;
  if (with_norm && !norm_fits(D, vec ? 4 : 1)) return static_cast<int>(cudaErrorInvalidValue);
  const auto* x = static_cast<const T*>(qkv);
  const auto *c = static_cast<const T*>(cos), *sn = static_cast<const T*>(sin);
  auto *oq = static_cast<T*>(q), *ok = static_cast<T*>(k), *ov = static_cast<T*>(v);
  if (vec && with_norm) fwd<T, 4, true>(x, c, sn, pos, cs_b, cs_s, oq, ok, ov, norm, B, S, H, G, D, R, stream);
  else if (vec) fwd<T, 4, false>(x, c, sn, pos, cs_b, cs_s, oq, ok, ov, norm, B, S, H, G, D, R, stream);
  else if (with_norm) fwd<T, 1, true>(x, c, sn, pos, cs_b, cs_s, oq, ok, ov, norm, B, S, H, G, D, R, stream);
  else fwd<T, 1, false>(x, c, sn, pos, cs_b, cs_s, oq, ok, ov, norm, B, S, H, G, D, R, stream);
  LORAQ_RETURN_LAST_ERROR;
}

template <typename T, int kV, bool kNorm>
void bwd(GradView gq, GradView gk, GradView gv, const T* c, const T* sn, const int64_t* pos, int64_t cs_b,
         int64_t cs_s, const T* x, const HeadNorm<T>& norm, T* out, int64_t B, int S, int H, int G, int D, int R,
         cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(B * S));
  rope_bwd_kernel<T, kV, kNorm><<<grid, loraq_threads_for((H + 2 * G) * D / (2 * kV), 512), 0, stream>>>(
      gq, gk, gv, c, sn, pos, cs_b, cs_s, x, norm, out, S, H, G, D, R);
}

template <typename T>
int launch_bwd(GradView gq, GradView gk, GradView gv, const void* cos, const void* sin, const int64_t* pos,
               int64_t cs_b, int64_t cs_s, const void* qkv, const HeadNorm<T>& norm, void* dqkv, int64_t B, int S,
               int H, int G, int D, int R, cudaStream_t stream) {
  const int elt = sizeof(T);
  bool vec = (R / 2) % 4 == 0 && ((D - R) / 2) % 4 == 0 && strides4(cs_b, cs_s, 0) && aligned4(cos, elt) &&
             aligned4(sin, elt) && aligned4(dqkv, elt) && aligned4(qkv, elt) && aligned4(norm.qw, elt) &&
             aligned4(norm.kw, elt);
  for (const GradView& g : {gq, gk, gv}) vec = vec && aligned4(g.p, elt) && strides4(g.sb, g.sh, g.ss);
  const bool with_norm = norm.qw != nullptr;
  if (with_norm && (qkv == nullptr || !norm_fits(D, vec ? 4 : 1))) return static_cast<int>(cudaErrorInvalidValue);
  const auto *c = static_cast<const T*>(cos), *sn = static_cast<const T*>(sin);
  const auto* x = static_cast<const T*>(qkv);
  auto* out = static_cast<T*>(dqkv);
  if (vec && with_norm) bwd<T, 4, true>(gq, gk, gv, c, sn, pos, cs_b, cs_s, x, norm, out, B, S, H, G, D, R, stream);
  else if (vec) bwd<T, 4, false>(gq, gk, gv, c, sn, pos, cs_b, cs_s, x, norm, out, B, S, H, G, D, R, stream);
  else if (with_norm) bwd<T, 1, true>(gq, gk, gv, c, sn, pos, cs_b, cs_s, x, norm, out, B, S, H, G, D, R, stream);
  else bwd<T, 1, false>(gq, gk, gv, c, sn, pos, cs_b, cs_s, x, norm, out, B, S, H, G, D, R, stream);
  LORAQ_RETURN_LAST_ERROR;
}

}  // namespace

extern "C" {

// qkv (B·S, (H+2G)·D) contiguous; cos/sin rows at b·cs_b + s·cs_s, or at pos[b·S + s]·cs_s when
// pos (B·S int64, every entry a row of the tables) is not null, R contiguous elements each (the
// rotary dims, R <= D, both even); q (B·S, H, D), k and v (B·S, G, D) contiguous outputs, v null
// to leave the v heads where they are (neither read nor copied).
// qw/kw (D,) the per-head q/k RMSNorm weights, or null for none (then eps/offset are unused).
int loraq_rope_fwd(const void* qkv, const void* cos, const void* sin, const int64_t* pos, int64_t cs_b, int64_t cs_s,
                   void* q, void* k, void* v, const void* qw, const void* kw, float eps, float offset, int dtype,
                   int64_t B, int S, int H, int G, int D, int R, cudaStream_t stream) {
  if (B == 0 || S == 0) return 0;
  if (D % 2 != 0 || R % 2 != 0 || R > D || R < 2 || B * S > 2147483647LL || (qw == nullptr) != (kw == nullptr))
    return static_cast<int>(cudaErrorInvalidValue);
  if (dtype == LORAQ_BF16) {
    using Bf = __nv_bfloat16;
    const HeadNorm<Bf> n{static_cast<const Bf*>(qw), static_cast<const Bf*>(kw), eps, offset};
    return launch_fwd<Bf>(qkv, cos, sin, pos, cs_b, cs_s, q, k, v, n, B, S, H, G, D, R, stream);
  }
  if (dtype == LORAQ_F32) {
    const HeadNorm<float> n{static_cast<const float*>(qw), static_cast<const float*>(kw), eps, offset};
    return launch_fwd<float>(qkv, cos, sin, pos, cs_b, cs_s, q, k, v, n, B, S, H, G, D, R, stream);
  }
  return static_cast<int>(cudaErrorInvalidValue);
}

// d* (B, heads, S, D) with strides (s*_b, s*_h, s*_s) and unit last stride; dqkv (B·S, (H+2G)·D).
// With qw/kw, qkv is the forward's input (needed by the norm's backward); else it may be null.
int loraq_rope_bwd(const void* dq, int64_t sq_b, int64_t sq_h, int64_t sq_s, const void* dk, int64_t sk_b,
                   int64_t sk_h, int64_t sk_s, const void* dv, int64_t sv_b, int64_t sv_h, int64_t sv_s,
                   const void* cos, const void* sin, const int64_t* pos, int64_t cs_b, int64_t cs_s, const void* qkv,
                   const void* qw, const void* kw, float eps, float offset, void* dqkv, int dtype, int64_t B, int S,
                   int H, int G, int D, int R, cudaStream_t stream) {
  if (B == 0 || S == 0) return 0;
  if (D % 2 != 0 || R % 2 != 0 || R > D || R < 2 || B * S > 2147483647LL || (qw == nullptr) != (kw == nullptr))
    return static_cast<int>(cudaErrorInvalidValue);
  const GradView gq{dq, sq_b, sq_h, sq_s}, gk{dk, sk_b, sk_h, sk_s}, gv{dv, sv_b, sv_h, sv_s};
  if (dtype == LORAQ_BF16) {
    using Bf = __nv_bfloat16;
    const HeadNorm<Bf> n{static_cast<const Bf*>(qw), static_cast<const Bf*>(kw), eps, offset};
    return launch_bwd<Bf>(gq, gk, gv, cos, sin, pos, cs_b, cs_s, qkv, n, dqkv, B, S, H, G, D, R, stream);
  }
  if (dtype == LORAQ_F32) {
    const HeadNorm<float> n{static_cast<const float*>(qw), static_cast<const float*>(kw), eps, offset};
    return launch_bwd<float>(gq, gk, gv, cos, sin, pos, cs_b, cs_s, qkv, n, dqkv, B, S, H, G, D, R, stream);
  }
  return static_cast<int>(cudaErrorInvalidValue);
}

}  // extern "C"
