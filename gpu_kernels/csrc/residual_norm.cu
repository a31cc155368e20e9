// A decoder layer's residual add fused with the RMSNorm that reads its sum, forward and backward,
// for rows of bf16 or fp32 activations (one block per row of D).
//
// Forward:   h = r + y'   (y' = y; or y' = norm_p(y) with Gemma's sandwich norms, where the
//                          sublayer's output is normalised before it joins the residual stream)
//            n = norm(h)
// with norm(x) = (o + w) ⊙ x · rstd, rstd = 1 / sqrt(mean(x²) + eps) (csrc/norm_act.cu). y' and h
// are rounded to T before they are read again, exactly where the separate norm, add and norm
// kernels round them, so the values are theirs. Writes h, n and rstd (M,) (and rstd_p (M,)).
// Saves two passes over (M, D) and one or two launches per residual step against three kernels.
//
// Backward (weights frozen): dh = dr_in + norm'ᵀ(dn)  — the gradient arriving on the residual
// stream plus the norm's, summed in fp32 and rounded once (dr_in null: none arrives);
//            dr = dh;  dy = dh (plain) or norm_p'ᵀ(dh) (sandwich)
// with norm'ᵀ(g) = rstd · (w'⊙g − x · rstd² · mean(w'⊙g⊙x)), w' = o + w.
// With the sandwich, the backward can take r instead of h (h null) and form h again from r, y and
// rstd_p with the forward's own rounding (`sandwich_sum`), bit for bit: a layer's first sandwich
// step then keeps no h of its own (r is the stream the previous step keeps, y the sandwich needs
// anyway), one (M, D) tensor a layer less for a few more reads in the backward.

#include "common.cuh"

namespace {

template <typename T>
__device__ __forceinline__ float rounded(float v);
template <>
__device__ __forceinline__ float rounded<float>(float v) { return v; }
template <>
__device__ __forceinline__ float rounded<__nv_bfloat16>(float v) { return __bfloat162float(__float2bfloat16(v)); }

// kN consecutive elements from index i: 8 as one vector (kN == 8, 16-byte aligned) or 1.
template <int kN, typename T>
__device__ __forceinline__ void ld(const T* p, int64_t i, float (&v)[kN]) {
  if constexpr (kN == 8) load8(p + i, v);
  else v[0] = loraq_load(p, i);
}
template <int kN, typename T>
__device__ __forceinline__ void st(T* p, int64_t i, const float (&v)[kN]) {
  if constexpr (kN == 8) store8(p + i, v);
  else loraq_store(p, i, v[0]);
}

// h = r + y, or r + norm_p(y) (kPre): y' and h each rounded to T as the separate ops round them.
// __fmul_rn/__fadd_rn are never contracted into an fma, so the backward's recomputation from r
// and y gives the forward's bits in fp32 too.
template <typename T, bool kPre>
__device__ __forceinline__ float sandwich_sum(float r, float y, float wp, float rstd_p, float offset) {
  if constexpr (kPre) y = rounded<T>(__fmul_rn(__fadd_rn(offset, wp), __fmul_rn(y, rstd_p)));
  return rounded<T>(__fadd_rn(r, y));
}

template <typename T, int kN, bool kPre>
__global__ void add_rmsnorm_fwd_kernel(const T* __restrict__ r, const T* __restrict__ y, const T* __restrict__ wp,
                                       const T* __restrict__ w, T* __restrict__ h, T* __restrict__ n,
                                       float* __restrict__ rstd_out, float* __restrict__ rstdp_out, int64_t D,
                                       float eps_p, float eps, float offset) {
  __shared__ float scratch[32];
  const int64_t row = blockIdx.x;
  const T *rr = r + row * D, *yr = y + row * D;
  T *hr = h + row * D, *nr = n + row * D;
  const int64_t step = static_cast<int64_t>(blockDim.x) * kN;
  float rstd_p = 1.f;
  if constexpr (kPre) {
    float ss = 0.f;
    for (int64_t i = threadIdx.x * kN; i < D; i += step) {
      float v[kN];
      ld<kN>(yr, i, v);
#pragma unroll
      for (int j = 0; j < kN; ++j) ss += v[j] * v[j];
    }
    rstd_p = rsqrtf(loraq_block_sum(ss, scratch) / static_cast<float>(D) + eps_p);
  }
  float ss = 0.f;
  for (int64_t i = threadIdx.x * kN; i < D; i += step) {
    float a[kN], b[kN];
    ld<kN>(rr, i, a);
    ld<kN>(yr, i, b);
    float c[kN] = {};
    if constexpr (kPre) ld<kN>(wp, i, c);
#pragma unroll
    for (int j = 0; j < kN; ++j) {
      a[j] = sandwich_sum<T, kPre>(a[j], b[j], c[j], rstd_p, offset);
      ss += a[j] * a[j];
    }
    st<kN>(hr, i, a);
  }
  const float rstd = rsqrtf(loraq_block_sum(ss, scratch) / static_cast<float>(D) + eps);
  for (int64_t i = threadIdx.x * kN; i < D; i += step) {  // h: what this thread wrote above
    float a[kN], c[kN];
    ld<kN>(hr, i, a);
    ld<kN>(w, i, c);
#pragma unroll
    for (int j = 0; j < kN; ++j) a[j] = (offset + c[j]) * (a[j] * rstd);
    st<kN>(nr, i, a);
  }
  if (threadIdx.x == 0) {
    rstd_out[row] = rstd;
    if constexpr (kPre) rstdp_out[row] = rstd_p;
  }
}

// h at [i, i + kN) of a row: read, or (h null; sandwich only) formed again from r and y.
template <int kN, typename T, bool kPre>
__device__ __forceinline__ void load_sum(const T* hr, const T* rr, const T* yr, const T* wp, float rstd_p,
                                         float offset, int64_t i, float (&c)[kN]) {
  if (kPre && hr == nullptr) {
    float b[kN], p[kN];
    ld<kN>(rr, i, c);
    ld<kN>(yr, i, b);
    ld<kN>(wp, i, p);
#pragma unroll
    for (int j = 0; j < kN; ++j) c[j] = sandwich_sum<T, kPre>(c[j], b[j], p[j], rstd_p, offset);
  } else {
    ld<kN>(hr, i, c);
  }
}

template <typename T, int kN, bool kPre>
__global__ void add_rmsnorm_bwd_kernel(const T* __restrict__ dr_in, const T* __restrict__ dn,
                                       const T* __restrict__ h, const T* __restrict__ r, const T* __restrict__ w,
                                       const float* __restrict__ rstd_in, const T* __restrict__ y,
                                       const T* __restrict__ wp, const float* __restrict__ rstdp_in,
                                       T* __restrict__ dh, T* __restrict__ dy, int64_t D, float offset) {
  __shared__ float scratch[32];
  const int64_t row = blockIdx.x;
  const T* dnr = dn + row * D;
  const T* hr = h != nullptr ? h + row * D : nullptr;
  const T* rr = r != nullptr ? r + row * D : nullptr;
  const T* yr = y != nullptr ? y + row * D : nullptr;
  const T* drr = dr_in != nullptr ? dr_in + row * D : nullptr;
  T* dhr = dh + row * D;
  const int64_t step = static_cast<int64_t>(blockDim.x) * kN;
  const float rstd = rstd_in[row];
  float rstd_p = 1.f;
  if constexpr (kPre) rstd_p = rstdp_in[row];
  float dot = 0.f;  // Σ w'·dn·h over the row
  for (int64_t i = threadIdx.x * kN; i < D; i += step) {
    float a[kN], b[kN], c[kN];
    ld<kN>(w, i, a);
    ld<kN>(dnr, i, b);
    load_sum<kN, T, kPre>(hr, rr, yr, wp, rstd_p, offset, i, c);
#pragma unroll
    for (int j = 0; j < kN; ++j) dot += (offset + a[j]) * b[j] * c[j];
  }
  const float coef = loraq_block_sum(dot, scratch) * rstd * rstd / static_cast<float>(D);
  float dot_p = 0.f;  // Σ w_p'·dh·y over the row (sandwich), with dh as rounded
  for (int64_t i = threadIdx.x * kN; i < D; i += step) {
    float a[kN], b[kN], c[kN], g[kN];
    ld<kN>(w, i, a);
    ld<kN>(dnr, i, b);
    load_sum<kN, T, kPre>(hr, rr, yr, wp, rstd_p, offset, i, c);
#pragma unroll
    for (int j = 0; j < kN; ++j) g[j] = 0.f;
    if (drr != nullptr) ld<kN>(drr, i, g);
#pragma unroll
    for (int j = 0; j < kN; ++j) g[j] = rounded<T>(g[j] + rstd * ((offset + a[j]) * b[j] - c[j] * coef));
    st<kN>(dhr, i, g);
    if constexpr (kPre) {
      ld<kN>(wp, i, a);
      ld<kN>(yr, i, c);
#pragma unroll
      for (int j = 0; j < kN; ++j) dot_p += (offset + a[j]) * g[j] * c[j];
    }
  }
  if constexpr (kPre) {
    const float coef_p = loraq_block_sum(dot_p, scratch) * rstd_p * rstd_p / static_cast<float>(D);
    T* dyr = dy + row * D;
    for (int64_t i = threadIdx.x * kN; i < D; i += step) {  // dh: what this thread wrote above
      float a[kN], g[kN], c[kN];
      ld<kN>(wp, i, a);
      ld<kN>(dhr, i, g);
      ld<kN>(yr, i, c);
#pragma unroll
      for (int j = 0; j < kN; ++j) g[j] = rstd_p * ((offset + a[j]) * g[j] - c[j] * coef_p);
      st<kN>(dyr, i, g);
    }
  }
}

// an optional operand (nullptr: not given) never blocks the vectorized path
bool aligned16_or_null(const void* p) { return p == nullptr || aligned16(p); }

template <typename T>
int launch_fwd(const void* r, const void* y, const void* wp, const void* w, void* h, void* n, float* rstd,
               float* rstd_p, int64_t M, int64_t D, float eps_p, float eps, float offset, cudaStream_t stream) {
  const bool vec = D % 8 == 0 && aligned16_or_null(r) && aligned16_or_null(y) && aligned16_or_null(wp) &&
                   aligned16_or_null(w) && aligned16_or_null(h) && aligned16_or_null(n);
  const auto *rp = static_cast<const T*>(r), *yp = static_cast<const T*>(y);
  const auto *wpp = static_cast<const T*>(wp), *wq = static_cast<const T*>(w);
  auto *hp = static_cast<T*>(h), *np = static_cast<T*>(n);
  const dim3 grid(static_cast<unsigned>(M));
  const int threads = loraq_row_threads(D, vec);
#define LORAQ_ADD_NORM_FWD(N, PRE)                                                                         \
  add_rmsnorm_fwd_kernel<T, N, PRE><<<grid, threads, 0, stream>>>(rp, yp, wpp, wq, hp, np, rstd, rstd_p, D, \
                                                                  eps_p, eps, offset)
  if (vec && wp != nullptr) LORAQ_ADD_NORM_FWD(8, true);
  else if (vec) LORAQ_ADD_NORM_FWD(8, false);
  else if (wp != nullptr) LORAQ_ADD_NORM_FWD(1, true);
  else LORAQ_ADD_NORM_FWD(1, false);
#undef LORAQ_ADD_NORM_FWD
  LORAQ_RETURN_LAST_ERROR;
}

template <typename T>
int launch_bwd(const void* dr_in, const void* dn, const void* h, const void* r, const void* w, const float* rstd,
               const void* y, const void* wp, const float* rstd_p, void* dh, void* dy, int64_t M, int64_t D,
               float offset, cudaStream_t stream) {
  const bool vec = D % 8 == 0 && aligned16_or_null(dr_in) && aligned16_or_null(dn) && aligned16_or_null(h) &&
                   aligned16_or_null(r) && aligned16_or_null(w) && aligned16_or_null(y) && aligned16_or_null(wp) &&
                   aligned16_or_null(dh) && aligned16_or_null(dy);
  const auto *a = static_cast<const T*>(dr_in), *b = static_cast<const T*>(dn), *c = static_cast<const T*>(h);
  const auto* rp = static_cast<const T*>(r);
  const auto *wq = static_cast<const T*>(w), *yp = static_cast<const T*>(y), *wpp = static_cast<const T*>(wp);
  auto *dhp = static_cast<T*>(dh), *dyp = static_cast<T*>(dy);
  const dim3 grid(static_cast<unsigned>(M));
  const int threads = loraq_row_threads(D, vec);
#define LORAQ_ADD_NORM_BWD(N, PRE)                                                                             \
  add_rmsnorm_bwd_kernel<T, N, PRE><<<grid, threads, 0, stream>>>(a, b, c, rp, wq, rstd, yp, wpp, rstd_p, dhp, \
                                                                  dyp, D, offset)
  if (vec && wp != nullptr) LORAQ_ADD_NORM_BWD(8, true);
  else if (vec) LORAQ_ADD_NORM_BWD(8, false);
  else if (wp != nullptr) LORAQ_ADD_NORM_BWD(1, true);
  else LORAQ_ADD_NORM_BWD(1, false);
#undef LORAQ_ADD_NORM_BWD
  LORAQ_RETURN_LAST_ERROR;
}

}  // namespace

extern "C" {

// r, y, h, n (M, D) contiguous; w, wp (D,) (wp null: no norm on y); rstd, rstd_p (M,) fp32 outputs
// (rstd_p only with wp). One offset (the family's) for both norms; eps_p is wp's norm's.
int loraq_add_rmsnorm_fwd(const void* r, const void* y, const void* wp, const void* w, void* h, void* n,
                          float* rstd, float* rstd_p, int dtype, int64_t M, int64_t D, float eps_p, float eps,
                          float offset, cudaStream_t stream) {
  if (M == 0) return 0;
  if (M > 2147483647LL || (wp != nullptr && rstd_p == nullptr)) return static_cast<int>(cudaErrorInvalidValue);
  if (dtype == LORAQ_BF16)
    return launch_fwd<__nv_bfloat16>(r, y, wp, w, h, n, rstd, rstd_p, M, D, eps_p, eps, offset, stream);
  if (dtype == LORAQ_F32) return launch_fwd<float>(r, y, wp, w, h, n, rstd, rstd_p, M, D, eps_p, eps, offset, stream);
  return static_cast<int>(cudaErrorInvalidValue);
}

// dr_in (M, D) or null (no gradient on the residual output), dn, h (M, D); w (D,), rstd (M,); with
// wp: y (M, D), rstd_p (M,) and dy (M, D) written; dh (M, D) written always (dy = dh without wp).
// h null: r (M, D) given instead and h formed again from r and y (with wp only).
int loraq_add_rmsnorm_bwd(const void* dr_in, const void* dn, const void* h, const void* r, const void* w,
                          const float* rstd, const void* y, const void* wp, const float* rstd_p, void* dh, void* dy,
                          int dtype, int64_t M, int64_t D, float offset, cudaStream_t stream) {
  if (M == 0) return 0;
  if (M > 2147483647LL || (wp != nullptr && (y == nullptr || rstd_p == nullptr || dy == nullptr)) ||
      (h == nullptr && (r == nullptr || wp == nullptr)))
    return static_cast<int>(cudaErrorInvalidValue);
  if (dtype == LORAQ_BF16)
    return launch_bwd<__nv_bfloat16>(dr_in, dn, h, r, w, rstd, y, wp, rstd_p, dh, dy, M, D, offset, stream);
  if (dtype == LORAQ_F32)
    return launch_bwd<float>(dr_in, dn, h, r, w, rstd, y, wp, rstd_p, dh, dy, M, D, offset, stream);
  return static_cast<int>(cudaErrorInvalidValue);
}

}  // extern "C"
