// RMSNorm and SwiGLU, forward and backward, for rows of bf16 or fp32 activations.
//
// RMSNorm:  y = (o + w) ⊙ x · rstd,  rstd = 1 / sqrt(mean(x²) + eps), one block per row of D;
//   the offset o is 0 (Llama: w starts at 1) or 1 (Gemma: w starts at 0), added in fp32.
//   backward (w frozen): dx = rstd · (w'⊙dy − x · rstd² · mean(w'⊙dy⊙x)), w' = o + w; rstd is
//   saved (M,) fp32.
// Gated MLP activation: h = act(g) ⊙ u; dg = dh ⊙ u ⊙ act'(g), du = dh ⊙ act(g), with act
//   SiLU (SwiGLU: silu' = σ(g)(1 + g(1 − σ(g)))) or tanh-approximated GELU (GeGLU, Gemma):
//   gelu(g) = g/2 · (1 + tanh(k(g + c·g³))), gelu' = (1 + t)/2 + g/2 · (1 − t²) · k(1 + 3c·g²).
//   gate/up may be two column blocks of one (M, 2F) buffer (row strides given), so the grouped
//   gate/up projection's output and gradient need no split or concatenation copies.

#include "common.cuh"
#include "glu_act.cuh"

namespace {

using glu::act_fwd;
using glu::act_fwd_grad;
using glu::kGeluTanh;
using glu::kSiLU;

// kVec: D % 8 == 0 and rows 16-byte aligned: each thread moves 8 elements per 16-byte access.
template <typename T, bool kVec>
__global__ void rmsnorm_fwd_kernel(const T* __restrict__ x, const T* __restrict__ w,
                                   T* __restrict__ y, float* __restrict__ rstd_out, int64_t D,
                                   float eps, float offset) {
  __shared__ float scratch[32];
  const int64_t row = blockIdx.x;
  const T* xr = x + row * D;
  T* yr = y + row * D;
  float ss = 0.f;
  if (kVec) {
    for (int64_t i = threadIdx.x * 8LL; i < D; i += blockDim.x * 8LL) {
      float v[8];
      load8(xr + i, v);
#pragma unroll
      for (int j = 0; j < 8; ++j) ss += v[j] * v[j];
    }
  } else {
    for (int64_t i = threadIdx.x; i < D; i += blockDim.x) {
      const float v = loraq_load(xr, i);
      ss += v * v;
    }
  }
  ss = loraq_block_sum(ss, scratch);
  const float rstd = rsqrtf(ss / static_cast<float>(D) + eps);
  if (kVec) {
    for (int64_t i = threadIdx.x * 8LL; i < D; i += blockDim.x * 8LL) {
      float v[8], wv[8];
      load8(xr + i, v);
      load8(w + i, wv);
#pragma unroll
      for (int j = 0; j < 8; ++j) v[j] = (offset + wv[j]) * (v[j] * rstd);
      store8(yr + i, v);
    }
  } else {
    for (int64_t i = threadIdx.x; i < D; i += blockDim.x)
      loraq_store(yr, i, (offset + loraq_load(w, i)) * (loraq_load(xr, i) * rstd));
  }
  if (threadIdx.x == 0) rstd_out[row] = rstd;
}

template <typename T, bool kVec>
__global__ void rmsnorm_bwd_kernel(const T* __restrict__ dy, const T* __restrict__ x,
                                   const T* __restrict__ w, const float* __restrict__ rstd_in,
                                   T* __restrict__ dx, int64_t D, float offset) {
  __shared__ float scratch[32];
  const int64_t row = blockIdx.x;
  const T* dyr = dy + row * D;
  const T* xr = x + row * D;
  T* dxr = dx + row * D;
  const float rstd = rstd_in[row];
  float dot = 0.f;  // Σ w·dy·x over the row
  if (kVec) {
    for (int64_t i = threadIdx.x * 8LL; i < D; i += blockDim.x * 8LL) {
      float a[8], b[8], c[8];
      load8(w + i, a);
      load8(dyr + i, b);
      load8(xr + i, c);
#pragma unroll
      for (int j = 0; j < 8; ++j) dot += (offset + a[j]) * b[j] * c[j];
    }
  } else {
    for (int64_t i = threadIdx.x; i < D; i += blockDim.x)
      dot += (offset + loraq_load(w, i)) * loraq_load(dyr, i) * loraq_load(xr, i);
  }
  dot = loraq_block_sum(dot, scratch);
  const float c = dot * rstd * rstd / static_cast<float>(D);
  if (kVec) {
    for (int64_t i = threadIdx.x * 8LL; i < D; i += blockDim.x * 8LL) {
      float a[8], b[8], v[8];
      load8(w + i, a);
      load8(dyr + i, b);
      load8(xr + i, v);
#pragma unroll
      for (int j = 0; j < 8; ++j) v[j] = rstd * ((offset + a[j]) * b[j] - v[j] * c);
      store8(dxr + i, v);
    }
  } else {
    for (int64_t i = threadIdx.x; i < D; i += blockDim.x)
      loraq_store(dxr, i, rstd * ((offset + loraq_load(w, i)) * loraq_load(dyr, i) - loraq_load(xr, i) * c));
  }
}

// Each thread owns 8 consecutive columns of a row; blocks stride over rows. kVec: every row
// start is 16-byte aligned and F % 8 == 0, so the 8 columns move as vectors.
template <typename T, bool kVec, int kAct>
__global__ void swiglu_fwd_kernel(const T* __restrict__ g, int64_t ldg, const T* __restrict__ u,
                                  int64_t ldu, T* __restrict__ h, int64_t M, int64_t F) {
  const int64_t f0 = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * 8;
  if (f0 >= F) return;
  for (int64_t m = blockIdx.y; m < M; m += gridDim.y) {
    const T* gr = g + m * ldg + f0;
    const T* ur = u + m * ldu + f0;
    T* hr = h + m * F + f0;
    if (kVec) {
      float gv[8], uv[8], hv[8];
      load8(gr, gv);
      load8(ur, uv);
#pragma unroll
      for (int j = 0; j < 8; ++j) hv[j] = act_fwd<kAct>(gv[j]) * uv[j];
      store8(hr, hv);
    } else {
      for (int j = 0; j < 8 && f0 + j < F; ++j) {
        loraq_store(hr, j, act_fwd<kAct>(loraq_load(gr, j)) * loraq_load(ur, j));
      }
    }
  }
}

template <typename T, bool kVec, int kAct>
__global__ void swiglu_bwd_kernel(const T* __restrict__ dh, const T* __restrict__ g, int64_t ldg,
                                  const T* __restrict__ u, int64_t ldu, T* __restrict__ dg,
                                  int64_t lddg, T* __restrict__ du, int64_t lddu, int64_t M,
                                  int64_t F) {
  const int64_t f0 = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * 8;
  if (f0 >= F) return;
  for (int64_t m = blockIdx.y; m < M; m += gridDim.y) {
    const T* dhr = dh + m * F + f0;
    const T* gr = g + m * ldg + f0;
    const T* ur = u + m * ldu + f0;
    T* dgr = dg + m * lddg + f0;
    T* dur = du + m * lddu + f0;
    if (kVec) {
      float dv[8], gv[8], uv[8], dgv[8], duv[8];
      load8(dhr, dv);
      load8(gr, gv);
      load8(ur, uv);
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        float a, da;
        act_fwd_grad<kAct>(gv[j], a, da);
        dgv[j] = dv[j] * uv[j] * da;
        duv[j] = dv[j] * a;
      }
      store8(dgr, dgv);
      store8(dur, duv);
    } else {
      for (int j = 0; j < 8 && f0 + j < F; ++j) {
        const float gv = loraq_load(gr, j), uv = loraq_load(ur, j), d = loraq_load(dhr, j);
        float a, da;
        act_fwd_grad<kAct>(gv, a, da);
        loraq_store(dgr, j, d * uv * da);
        loraq_store(dur, j, d * a);
      }
    }
  }
}

dim3 swiglu_grid(int64_t M, int64_t F, int threads) {
  const int64_t col_blocks = (F + 8LL * threads - 1) / (8LL * threads);
  return dim3(static_cast<unsigned>(col_blocks), static_cast<unsigned>(M < 65535 ? M : 65535));
}

constexpr int kGluThreads = 128;

// gate and up operands with their row strides; the gradients likewise
template <typename T>
struct Glu {
  const T* g;
  const T* u;
  int64_t ldg, ldu;
};
template <typename T>
struct GluGrad {
  const T* dh;
  T* dg;
  T* du;
  int64_t lddg, lddu;
};

template <typename T, int kAct>
void glu_fwd(const Glu<T>& a, T* h, int64_t M, int64_t F, bool vec, cudaStream_t stream) {
  const dim3 grid = swiglu_grid(M, F, kGluThreads);
  if (vec) swiglu_fwd_kernel<T, true, kAct><<<grid, kGluThreads, 0, stream>>>(a.g, a.ldg, a.u, a.ldu, h, M, F);
  else swiglu_fwd_kernel<T, false, kAct><<<grid, kGluThreads, 0, stream>>>(a.g, a.ldg, a.u, a.ldu, h, M, F);
}

template <typename T, int kAct>
void glu_bwd(const Glu<T>& a, const GluGrad<T>& d, int64_t M, int64_t F, bool vec, cudaStream_t stream) {
  const dim3 grid = swiglu_grid(M, F, kGluThreads);
  if (vec)
    swiglu_bwd_kernel<T, true, kAct><<<grid, kGluThreads, 0, stream>>>(d.dh, a.g, a.ldg, a.u, a.ldu, d.dg, d.lddg,
                                                                       d.du, d.lddu, M, F);
  else
    swiglu_bwd_kernel<T, false, kAct><<<grid, kGluThreads, 0, stream>>>(d.dh, a.g, a.ldg, a.u, a.ldu, d.dg,
                                                                        d.lddg, d.du, d.lddu, M, F);
}



}  // namespace

extern "C" {

int loraq_rmsnorm_fwd(const void* x, const void* w, void* y, float* rstd, int dtype, int64_t M,
                      int64_t D, float eps, float offset, cudaStream_t stream) {
  if (M == 0) return 0;
  if (M > 2147483647LL) return static_cast<int>(cudaErrorInvalidValue);
  const bool vec = D % 8 == 0 && aligned16(x) && aligned16(w) && aligned16(y);
  const int threads = loraq_row_threads(D, vec);
  const unsigned grid = static_cast<unsigned>(M);
  if (dtype == LORAQ_BF16) {
    using B = __nv_bfloat16;
    auto* xp = static_cast<const B*>(x);
    auto* wp = static_cast<const B*>(w);
    auto* yp = static_cast<B*>(y);
    if (vec) rmsnorm_fwd_kernel<B, true><<<grid, threads, 0, stream>>>(xp, wp, yp, rstd, D, eps, offset);
    else rmsnorm_fwd_kernel<B, false><<<grid, threads, 0, stream>>>(xp, wp, yp, rstd, D, eps, offset);
  } else if (dtype == LORAQ_F32) {
    auto* xp = static_cast<const float*>(x);
    auto* wp = static_cast<const float*>(w);
    auto* yp = static_cast<float*>(y);
    if (vec) rmsnorm_fwd_kernel<float, true><<<grid, threads, 0, stream>>>(xp, wp, yp, rstd, D, eps, offset);
    else rmsnorm_fwd_kernel<float, false><<<grid, threads, 0, stream>>>(xp, wp, yp, rstd, D, eps, offset);
  } else {
    return static_cast<int>(cudaErrorInvalidValue);
  }
  LORAQ_RETURN_LAST_ERROR;
}

int loraq_rmsnorm_bwd(const void* dy, const void* x, const void* w, const float* rstd, void* dx,
                      int dtype, int64_t M, int64_t D, float offset, cudaStream_t stream) {
  if (M == 0) return 0;
  if (M > 2147483647LL) return static_cast<int>(cudaErrorInvalidValue);
  const bool vec = D % 8 == 0 && aligned16(dy) && aligned16(x) && aligned16(w) && aligned16(dx);
  const int threads = loraq_row_threads(D, vec);
  const unsigned grid = static_cast<unsigned>(M);
  if (dtype == LORAQ_BF16) {
    using B = __nv_bfloat16;
    auto* a = static_cast<const B*>(dy);
    auto* xp = static_cast<const B*>(x);
    auto* wp = static_cast<const B*>(w);
    auto* o = static_cast<B*>(dx);
    if (vec) rmsnorm_bwd_kernel<B, true><<<grid, threads, 0, stream>>>(a, xp, wp, rstd, o, D, offset);
    else rmsnorm_bwd_kernel<B, false><<<grid, threads, 0, stream>>>(a, xp, wp, rstd, o, D, offset);
  } else if (dtype == LORAQ_F32) {
    auto* a = static_cast<const float*>(dy);
    auto* xp = static_cast<const float*>(x);
    auto* wp = static_cast<const float*>(w);
    auto* o = static_cast<float*>(dx);
    if (vec) rmsnorm_bwd_kernel<float, true><<<grid, threads, 0, stream>>>(a, xp, wp, rstd, o, D, offset);
    else rmsnorm_bwd_kernel<float, false><<<grid, threads, 0, stream>>>(a, xp, wp, rstd, o, D, offset);
  } else {
    return static_cast<int>(cudaErrorInvalidValue);
  }
  LORAQ_RETURN_LAST_ERROR;
}

// h (M, F) contiguous; g and u rows start every ldg / ldu elements; act: kSiLU or kGeluTanh.
int loraq_swiglu_fwd(const void* g, int64_t ldg, const void* u, int64_t ldu, void* h, int dtype,
                     int64_t M, int64_t F, int act, cudaStream_t stream) {
  if (M == 0 || F == 0) return 0;
  if (act != kSiLU && act != kGeluTanh) return static_cast<int>(cudaErrorInvalidValue);
  const bool vec = aligned16(g) && aligned16(u) && aligned16(h) && ldg % 8 == 0 && ldu % 8 == 0 && F % 8 == 0;
  if (dtype == LORAQ_BF16) {
    using B = __nv_bfloat16;
    const Glu<B> a{static_cast<const B*>(g), static_cast<const B*>(u), ldg, ldu};
    auto* hp = static_cast<B*>(h);
    if (act == kSiLU) glu_fwd<B, kSiLU>(a, hp, M, F, vec, stream);
    else glu_fwd<B, kGeluTanh>(a, hp, M, F, vec, stream);
  } else if (dtype == LORAQ_F32) {
    const Glu<float> a{static_cast<const float*>(g), static_cast<const float*>(u), ldg, ldu};
    auto* hp = static_cast<float*>(h);
    if (act == kSiLU) glu_fwd<float, kSiLU>(a, hp, M, F, vec, stream);
    else glu_fwd<float, kGeluTanh>(a, hp, M, F, vec, stream);
  } else {
    return static_cast<int>(cudaErrorInvalidValue);
  }
  LORAQ_RETURN_LAST_ERROR;
}

// dh (M, F) contiguous; dg / du rows start every lddg / lddu elements.
int loraq_swiglu_bwd(const void* dh, const void* g, int64_t ldg, const void* u, int64_t ldu,
                     void* dg, int64_t lddg, void* du, int64_t lddu, int dtype, int64_t M,
                     int64_t F, int act, cudaStream_t stream) {
  if (M == 0 || F == 0) return 0;
  if (act != kSiLU && act != kGeluTanh) return static_cast<int>(cudaErrorInvalidValue);
  const bool vec = aligned16(dh) && aligned16(g) && aligned16(u) && aligned16(dg) && aligned16(du) &&
                   ldg % 8 == 0 && ldu % 8 == 0 && lddg % 8 == 0 && lddu % 8 == 0 && F % 8 == 0;
  if (dtype == LORAQ_BF16) {
    using B = __nv_bfloat16;
    const Glu<B> a{static_cast<const B*>(g), static_cast<const B*>(u), ldg, ldu};
    const GluGrad<B> d{static_cast<const B*>(dh), static_cast<B*>(dg), static_cast<B*>(du), lddg, lddu};
    if (act == kSiLU) glu_bwd<B, kSiLU>(a, d, M, F, vec, stream);
    else glu_bwd<B, kGeluTanh>(a, d, M, F, vec, stream);
  } else if (dtype == LORAQ_F32) {
    const Glu<float> a{static_cast<const float*>(g), static_cast<const float*>(u), ldg, ldu};
    const GluGrad<float> d{static_cast<const float*>(dh), static_cast<float*>(dg), static_cast<float*>(du),
                           lddg, lddu};
    if (act == kSiLU) glu_bwd<float, kSiLU>(a, d, M, F, vec, stream);
    else glu_bwd<float, kGeluTanh>(a, d, M, F, vec, stream);
  } else {
    return static_cast<int>(cudaErrorInvalidValue);
  }
  LORAQ_RETURN_LAST_ERROR;
}

}  // extern "C"
