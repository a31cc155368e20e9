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

// One block per token; each thread takes kV consecutive pairs (i, i + D/2) of one head, so a
// warp's loads are consecutive in i (coalesced, 8- or 16-byte vectors when kV == 4) and the
// rotation needs no exchange between threads.
template <typename T, int kV>
__global__ void rope_fwd_kernel(const T* __restrict__ qkv, const T* __restrict__ cos, const T* __restrict__ sin,
                                const int64_t* __restrict__ pos, int64_t cs_b, int64_t cs_s, T* __restrict__ q,
                                T* __restrict__ k, T* __restrict__ v,
                                int S, int H, int G, int D) {
  const int64_t m = blockIdx.x;  // token b·S + s
  const int64_t b = m / S, s = m % S;
  const int half = D / 2, groups = half / kV;
  const int heads = H + 2 * G;
  const T* x = qkv + m * heads * D;
  const int64_t a = angle_offset(pos, m, b, s, cs_b, cs_s);
  const T *c = cos + a, *sn = sin + a;
  for (int t = threadIdx.x; t < heads * groups; t += blockDim.x) {
    const int h = t / groups, i = (t % groups) * kV;
    float x0[kV], x1[kV];
    load_v<kV>(x + h * D + i, x0);
    load_v<kV>(x + h * D + i + half, x1);
    if (h >= H + G) {  // v: copied
      T* o = v + (m * G + (h - H - G)) * D;
      store_v<kV>(o + i, x0);
      store_v<kV>(o + i + half, x1);
      continue;
    }
    float c0[kV], c1[kV], s0[kV], s1[kV], o0[kV], o1[kV];
    load_angles<kV>(c, sn, i, half, c0, c1, s0, s1);
#pragma unroll
    for (int j = 0; j < kV; ++j) {
      o0[j] = x0[j] * c0[j] - x1[j] * s0[j];
      o1[j] = x1[j] * c1[j] + x0[j] * s1[j];
    }
    T* o = h < H ? q + (m * H + h) * D : k + (m * G + (h - H)) * D;
    store_v<kV>(o + i, o0);
    store_v<kV>(o + i + half, o1);
  }
}

// dq/dk/dv come from attention's backward as (B, heads, S, D) tensors with any strides but a
// unit last one: (b, h, s) strides are passed per tensor.
struct GradView {
  const void* p;
  int64_t sb, sh, ss;
};

template <typename T, int kV>
__global__ void rope_bwd_kernel(GradView dq, GradView dk, GradView dv, const T* __restrict__ cos,
                                const T* __restrict__ sin, const int64_t* __restrict__ pos, int64_t cs_b,
                                int64_t cs_s, T* __restrict__ dqkv,
                                int S, int H, int G, int D) {
  const int64_t m = blockIdx.x;
  const int64_t b = m / S, s = m % S;
  const int half = D / 2, groups = half / kV;
  const int heads = H + 2 * G;
  T* out = dqkv + m * heads * D;
  const int64_t a = angle_offset(pos, m, b, s, cs_b, cs_s);
  const T *c = cos + a, *sn = sin + a;
  for (int t = threadIdx.x; t < heads * groups; t += blockDim.x) {
    const int h = t / groups, i = (t % groups) * kV;
    // pick the tensor by value (a runtime-chosen reference to a kernel parameter would put the
    // parameters in local memory)
    const bool is_q = h < H, is_k = !is_q && h < H + G;
    const int hh = is_q ? h : (is_k ? h - H : h - H - G);
    const void* base = is_q ? dq.p : (is_k ? dk.p : dv.p);
    const int64_t off = is_q ? b * dq.sb + hh * dq.sh + s * dq.ss
                             : (is_k ? b * dk.sb + hh * dk.sh + s * dk.ss : b * dv.sb + hh * dv.sh + s * dv.ss);
    const T* src = static_cast<const T*>(base) + off;
    float g0[kV], g1[kV];
    load_v<kV>(src + i, g0);
    load_v<kV>(src + i + half, g1);
    if (h >= H + G) {
      store_v<kV>(out + h * D + i, g0);
      store_v<kV>(out + h * D + i + half, g1);
      continue;
    }
    float c0[kV], c1[kV], s0[kV], s1[kV], d0[kV], d1[kV];
    load_angles<kV>(c, sn, i, half, c0, c1, s0, s1);
#pragma unroll
    for (int j = 0; j < kV; ++j) {
      d0[j] = g0[j] * c0[j] + g1[j] * s1[j];
      d1[j] = g1[j] * c1[j] - g0[j] * s0[j];
    }
    store_v<kV>(out + h * D + i, d0);
    store_v<kV>(out + h * D + i + half, d1);
  }
}

int threads_for(int work) {
  const int t = ((work + 31) / 32) * 32;
  return t < 64 ? 64 : (t > 512 ? 512 : t);
}

// Vector moves need every row start aligned to 4 elements: D/2 % 4 == 0, 4-element-aligned
// strides and base pointers.
bool aligned4(const void* p, int elt) { return reinterpret_cast<uintptr_t>(p) % (4 * elt) == 0; }
bool strides4(int64_t a, int64_t b, int64_t c) { return a % 4 == 0 && b % 4 == 0 && c % 4 == 0; }

template <typename T>
int launch_fwd(const void* qkv, const void* cos, const void* sin, const int64_t* pos, int64_t cs_b, int64_t cs_s,
               void* q, void* k, void* v, int64_t B, int S, int H, int G, int D, cudaStream_t stream) {
  const int elt = sizeof(T);
  const bool vec = (D / 2) % 4 == 0 && strides4(cs_b, cs_s, 0) && aligned4(qkv, elt) && aligned4(cos, elt) &&
                   aligned4(sin, elt) && aligned4(q, elt) && aligned4(k, elt) && aligned4(v, elt);
  const dim3 grid(static_cast<unsigned>(B * S));
  const auto* x = static_cast<const T*>(qkv);
  const auto *c = static_cast<const T*>(cos), *sn = static_cast<const T*>(sin);
  auto *oq = static_cast<T*>(q), *ok = static_cast<T*>(k), *ov = static_cast<T*>(v);
  if (vec)
    rope_fwd_kernel<T, 4><<<grid, threads_for((H + 2 * G) * D / 8), 0, stream>>>(x, c, sn, pos, cs_b, cs_s, oq, ok,
                                                                                   ov, S, H, G, D);
  else
    rope_fwd_kernel<T, 1><<<grid, threads_for((H + 2 * G) * D / 2), 0, stream>>>(x, c, sn, pos, cs_b, cs_s, oq, ok,
                                                                                   ov, S, H, G, D);
  LORAQ_RETURN_LAST_ERROR;
}

template <typename T>
int launch_bwd(GradView gq, GradView gk, GradView gv, const void* cos, const void* sin, const int64_t* pos,
               int64_t cs_b, int64_t cs_s, void* dqkv, int64_t B, int S, int H, int G, int D, cudaStream_t stream) {
  const int elt = sizeof(T);
  bool vec = (D / 2) % 4 == 0 && strides4(cs_b, cs_s, 0) && aligned4(cos, elt) && aligned4(sin, elt) &&
             aligned4(dqkv, elt);
  for (const GradView& g : {gq, gk, gv}) vec = vec && aligned4(g.p, elt) && strides4(g.sb, g.sh, g.ss);
  const dim3 grid(static_cast<unsigned>(B * S));
  const auto *c = static_cast<const T*>(cos), *sn = static_cast<const T*>(sin);
  auto* out = static_cast<T*>(dqkv);
  if (vec)
    rope_bwd_kernel<T, 4><<<grid, threads_for((H + 2 * G) * D / 8), 0, stream>>>(gq, gk, gv, c, sn, pos, cs_b, cs_s,
                                                                                   out, S, H, G, D);
  else
    rope_bwd_kernel<T, 1><<<grid, threads_for((H + 2 * G) * D / 2), 0, stream>>>(gq, gk, gv, c, sn, pos, cs_b, cs_s,
                                                                                   out, S, H, G, D);
  LORAQ_RETURN_LAST_ERROR;
}

}  // namespace

extern "C" {

// qkv (B·S, (H+2G)·D) contiguous; cos/sin rows at b·cs_b + s·cs_s, or at pos[b·S + s]·cs_s when
// pos (B·S int64, every entry a row of the tables) is not null, D contiguous elements each;
// q (B·S, H, D), k and v (B·S, G, D) contiguous outputs.
int loraq_rope_fwd(const void* qkv, const void* cos, const void* sin, const int64_t* pos, int64_t cs_b, int64_t cs_s,
                   void* q, void* k, void* v, int dtype, int64_t B, int S, int H, int G, int D,
                   cudaStream_t stream) {
  if (B == 0 || S == 0) return 0;
  if (D % 2 != 0 || B * S > 2147483647LL) return static_cast<int>(cudaErrorInvalidValue);
  if (dtype == LORAQ_BF16)
    return launch_fwd<__nv_bfloat16>(qkv, cos, sin, pos, cs_b, cs_s, q, k, v, B, S, H, G, D, stream);
  if (dtype == LORAQ_F32)
    return launch_fwd<float>(qkv, cos, sin, pos, cs_b, cs_s, q, k, v, B, S, H, G, D, stream);
  return static_cast<int>(cudaErrorInvalidValue);
}

// d* (B, heads, S, D) with strides (s*_b, s*_h, s*_s) and unit last stride; dqkv (B·S, (H+2G)·D).
int loraq_rope_bwd(const void* dq, int64_t sq_b, int64_t sq_h, int64_t sq_s, const void* dk, int64_t sk_b,
                   int64_t sk_h, int64_t sk_s, const void* dv, int64_t sv_b, int64_t sv_h, int64_t sv_s,
                   const void* cos, const void* sin, const int64_t* pos, int64_t cs_b, int64_t cs_s, void* dqkv,
                   int dtype, int64_t B, int S, int H, int G, int D, cudaStream_t stream) {
  if (B == 0 || S == 0) return 0;
  if (D % 2 != 0 || B * S > 2147483647LL) return static_cast<int>(cudaErrorInvalidValue);
  const GradView gq{dq, sq_b, sq_h, sq_s}, gk{dk, sk_b, sk_h, sk_s}, gv{dv, sv_b, sv_h, sv_s};
  if (dtype == LORAQ_BF16)
    return launch_bwd<__nv_bfloat16>(gq, gk, gv, cos, sin, pos, cs_b, cs_s, dqkv, B, S, H, G, D, stream);
  if (dtype == LORAQ_F32)
    return launch_bwd<float>(gq, gk, gv, cos, sin, pos, cs_b, cs_s, dqkv, B, S, H, G, D, stream);
  return static_cast<int>(cudaErrorInvalidValue);
}

}  // extern "C"
