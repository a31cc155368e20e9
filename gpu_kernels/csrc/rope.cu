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
// cos/sin (Bc, S, D) with Bc = 1 (broadcast, batch stride 0) or B. Math in fp32, one rounding.

#include "common.cuh"

namespace {

// One block per token; each thread takes a pair (i, i + D/2) of one head, so the loads of a
// warp are consecutive in i (coalesced) and the rotation needs no exchange between threads.
template <typename T>
__global__ void rope_fwd_kernel(const T* __restrict__ qkv, const T* __restrict__ cos, const T* __restrict__ sin,
                                int64_t cs_b, int64_t cs_s, T* __restrict__ q, T* __restrict__ k, T* __restrict__ v,
                                int S, int H, int G, int D) {
  const int64_t m = blockIdx.x;  // token b·S + s
  const int64_t b = m / S, s = m % S;
  const int half = D / 2;
  const int heads = H + 2 * G;
  const T* x = qkv + m * heads * D;
  const T* c = cos + b * cs_b + s * cs_s;
  const T* sn = sin + b * cs_b + s * cs_s;
  for (int t = threadIdx.x; t < heads * half; t += blockDim.x) {
    const int h = t / half, i = t % half;
    const float x0 = loraq_load(x, h * D + i), x1 = loraq_load(x, h * D + i + half);
    if (h >= H + G) {  // v: copied
      T* o = v + (m * G + (h - H - G)) * D;
      loraq_store(o, i, x0);
      loraq_store(o, i + half, x1);
      continue;
    }
    const float c0 = loraq_load(c, i), c1 = loraq_load(c, i + half);
    const float s0 = loraq_load(sn, i), s1 = loraq_load(sn, i + half);
    T* o = h < H ? q + (m * H + h) * D : k + (m * G + (h - H)) * D;
    loraq_store(o, i, x0 * c0 - x1 * s0);
    loraq_store(o, i + half, x1 * c1 + x0 * s1);
  }
}

// dq/dk/dv come from attention's backward as (B, heads, S, D) tensors with any strides but a
// unit last one: (b, h, s) strides are passed per tensor.
struct GradView {
  const void* p;
  int64_t sb, sh, ss;
};

template <typename T>
__global__ void rope_bwd_kernel(GradView dq, GradView dk, GradView dv, const T* __restrict__ cos,
                                const T* __restrict__ sin, int64_t cs_b, int64_t cs_s, T* __restrict__ dqkv,
                                int S, int H, int G, int D) {
  const int64_t m = blockIdx.x;
  const int64_t b = m / S, s = m % S;
  const int half = D / 2;
  const int heads = H + 2 * G;
  T* out = dqkv + m * heads * D;
  const T* c = cos + b * cs_b + s * cs_s;
  const T* sn = sin + b * cs_b + s * cs_s;
  for (int t = threadIdx.x; t < heads * half; t += blockDim.x) {
    const int h = t / half, i = t % half;
    // pick the tensor by value (a runtime-chosen reference to a kernel parameter would put the
    // parameters in local memory)
    const bool is_q = h < H, is_k = !is_q && h < H + G;
    const int hh = is_q ? h : (is_k ? h - H : h - H - G);
    const void* base = is_q ? dq.p : (is_k ? dk.p : dv.p);
    const int64_t off = is_q ? b * dq.sb + hh * dq.sh + s * dq.ss
                             : (is_k ? b * dk.sb + hh * dk.sh + s * dk.ss : b * dv.sb + hh * dv.sh + s * dv.ss);
    const T* src = static_cast<const T*>(base) + off;
    const float g0 = loraq_load(src, i), g1 = loraq_load(src, i + half);
    if (h >= H + G) {
      loraq_store(out, h * D + i, g0);
      loraq_store(out, h * D + i + half, g1);
      continue;
    }
    const float c0 = loraq_load(c, i), c1 = loraq_load(c, i + half);
    const float s0 = loraq_load(sn, i), s1 = loraq_load(sn, i + half);
    loraq_store(out, h * D + i, g0 * c0 + g1 * s1);
    loraq_store(out, h * D + i + half, g1 * c1 - g0 * s0);
  }
}

int threads_for(int pairs) {
  const int t = ((pairs + 31) / 32) * 32;
  return t < 64 ? 64 : (t > 512 ? 512 : t);
}

}  // namespace

extern "C" {

// qkv (B·S, (H+2G)·D) contiguous; cos/sin rows at b·cs_b + s·cs_s, D contiguous elements each;
// q (B·S, H, D), k and v (B·S, G, D) contiguous outputs.
int loraq_rope_fwd(const void* qkv, const void* cos, const void* sin, int64_t cs_b, int64_t cs_s, void* q,
                   void* k, void* v, int dtype, int64_t B, int S, int H, int G, int D, cudaStream_t stream) {
  if (B == 0 || S == 0) return 0;
  if (D % 2 != 0 || B * S > 2147483647LL) return static_cast<int>(cudaErrorInvalidValue);
  const dim3 grid(static_cast<unsigned>(B * S));
  const int threads = threads_for((H + 2 * G) * D / 2);
  if (dtype == LORAQ_BF16) {
    using T = __nv_bfloat16;
    rope_fwd_kernel<T><<<grid, threads, 0, stream>>>(
        static_cast<const T*>(qkv), static_cast<const T*>(cos), static_cast<const T*>(sin), cs_b, cs_s,
        static_cast<T*>(q), static_cast<T*>(k), static_cast<T*>(v), S, H, G, D);
  } else if (dtype == LORAQ_F32) {
    rope_fwd_kernel<float><<<grid, threads, 0, stream>>>(
        static_cast<const float*>(qkv), static_cast<const float*>(cos), static_cast<const float*>(sin), cs_b,
        cs_s, static_cast<float*>(q), static_cast<float*>(k), static_cast<float*>(v), S, H, G, D);
  } else {
    return static_cast<int>(cudaErrorInvalidValue);
  }
  LORAQ_RETURN_LAST_ERROR;
}

// d* (B, heads, S, D) with strides (s*_b, s*_h, s*_s) and unit last stride; dqkv (B·S, (H+2G)·D).
int loraq_rope_bwd(const void* dq, int64_t sq_b, int64_t sq_h, int64_t sq_s, const void* dk, int64_t sk_b,
                   int64_t sk_h, int64_t sk_s, const void* dv, int64_t sv_b, int64_t sv_h, int64_t sv_s,
                   const void* cos, const void* sin, int64_t cs_b, int64_t cs_s, void* dqkv, int dtype, int64_t B,
                   int S, int H, int G, int D, cudaStream_t stream) {
  if (B == 0 || S == 0) return 0;
  if (D % 2 != 0 || B * S > 2147483647LL) return static_cast<int>(cudaErrorInvalidValue);
  const GradView gq{dq, sq_b, sq_h, sq_s}, gk{dk, sk_b, sk_h, sk_s}, gv{dv, sv_b, sv_h, sv_s};
  const dim3 grid(static_cast<unsigned>(B * S));
  const int threads = threads_for((H + 2 * G) * D / 2);
  if (dtype == LORAQ_BF16) {
    using T = __nv_bfloat16;
    rope_bwd_kernel<T><<<grid, threads, 0, stream>>>(gq, gk, gv, static_cast<const T*>(cos),
                                                     static_cast<const T*>(sin), cs_b, cs_s,
                                                     static_cast<T*>(dqkv), S, H, G, D);
  } else if (dtype == LORAQ_F32) {
    rope_bwd_kernel<float><<<grid, threads, 0, stream>>>(gq, gk, gv, static_cast<const float*>(cos),
                                                         static_cast<const float*>(sin), cs_b, cs_s,
                                                         static_cast<float*>(dqkv), S, H, G, D);
  } else {
    return static_cast<int>(cudaErrorInvalidValue);
  }
  LORAQ_RETURN_LAST_ERROR;
}

}  // extern "C"
