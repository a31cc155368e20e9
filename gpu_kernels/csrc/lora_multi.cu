// Mixed-adapter LoRA for serving (BGMV, as in Punica and S-LoRA): every token carries an adapter
// slot, and the LoRA term of its own slot is added, in place, to the base GEMM's output:
//
//   y[t, n] += scales[i] · Σ_r xa[t, r] · B[i, n, r],   xa[t, r] = Σ_k x[t, k] · A[i, r, k]
//   i = index[t / S]        (T = rows·S tokens; a row's S tokens share its slot)
//
// x (T, K) and y (T, N) are bf16 or fp32 rows; A (slots, R, K), B (slots, N, R) and scales
// (slots,) are fp32 (the adapters' masters); every sum is taken in fp32 and y is rounded once.
// A slot of scale 0 (slot 0, "no adapter") or outside [0, slots) adds nothing: its tokens return
// before reading anything, in both kernels.
//
// Two launches, no host sync and no allocation (a CUDA graph can capture them):
//   shrink  grid (T, splits): block (t, s) dots x[t, chunk s] with the R rows of A[i] and writes
//           R partial sums to partials[t, s, :] (a K split keeps a decode batch of 32 tokens on
//           more than 32 SMs; no atomics, so the result does not depend on timing);
//   expand  grid (T, column blocks): sums the splits into xa[t, :] (shared memory), then each
//           thread adds the rank-R dot of one column of y.
#include "common.cuh"

namespace {

constexpr int kShrinkThreads = 128;
constexpr int kShrinkChunk = kShrinkThreads * 8;  // K elements per shrink block: 8 per thread
constexpr int kExpandThreads = 256;
constexpr int kMaxRank = 64;

__device__ __forceinline__ bool live_slot(const int64_t* index, const float* scales, int64_t n_slots,
                                          int64_t row, int64_t* slot, float* scale) {
  const int64_t i = index[row];
  if (i < 0 || i >= n_slots) return false;
  const float s = scales[i];
  if (s == 0.f) return false;
  *slot = i;
  *scale = s;
  return true;
}

// kVec: K % 8 == 0 and x, A 16-byte aligned, so every thread moves whole 8-element vectors.
template <typename T, int kR, bool kVec>
__global__ void __launch_bounds__(kShrinkThreads)
    shrink_kernel(const T* __restrict__ x, int64_t K, int64_t S, const float* __restrict__ A,
                  const float* __restrict__ scales, const int64_t* __restrict__ index, int64_t n_slots,
                  int R, float* __restrict__ partials, int splits) {
  const int64_t t = blockIdx.x;
  const int split = blockIdx.y;
  int64_t slot;
  float scale;
  if (!live_slot(index, scales, n_slots, t / S, &slot, &scale)) return;
  const int64_t k = static_cast<int64_t>(split) * kShrinkChunk + threadIdx.x * 8;
  const T* xr = x + t * K;
  const float* a = A + slot * R * K;

  float acc[kR];
#pragma unroll
  for (int r = 0; r < kR; ++r) acc[r] = 0.f;
  float xv[8];
  if (kVec && k + 8 <= K) {
    load8(xr + k, xv);
#pragma unroll
    for (int r = 0; r < kR; ++r) {
      if (r < R) {
        float av[8];
        load8(a + r * K + k, av);
#pragma unroll
        for (int c = 0; c < 8; ++c) acc[r] += xv[c] * av[c];
      }
    }
  } else {
#pragma unroll
    for (int c = 0; c < 8; ++c) xv[c] = k + c < K ? loraq_load(xr, k + c) : 0.f;
#pragma unroll
    for (int r = 0; r < kR; ++r) {
      if (r < R) {
#pragma unroll
        for (int c = 0; c < 8; ++c)
          if (k + c < K) acc[r] += xv[c] * a[r * K + k + c];
      }
    }
  }

  // block sum of every acc[r]: warp shuffles, then one value per warp through shared memory
  __shared__ float warp_sums[kShrinkThreads / 32][kR];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int r = 0; r < kR; ++r) {
    float v = acc[r];
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    if (lane == 0) warp_sums[warp][r] = v;
  }
  __syncthreads();
  if (threadIdx.x < R) {
    float v = 0.f;
#pragma unroll
    for (int w = 0; w < kShrinkThreads / 32; ++w) v += warp_sums[w][threadIdx.x];
    partials[(t * splits + split) * R + threadIdx.x] = v;
  }
}

template <typename T>
__global__ void __launch_bounds__(kExpandThreads)
    expand_kernel(T* __restrict__ y, int64_t N, int64_t S, const float* __restrict__ B,
                  const float* __restrict__ scales, const int64_t* __restrict__ index, int64_t n_slots,
                  int R, const float* __restrict__ partials, int splits) {
  const int64_t t = blockIdx.x;
  int64_t slot;
  float scale;
  if (!live_slot(index, scales, n_slots, t / S, &slot, &scale)) return;
  __shared__ __align__(16) float xa[kMaxRank];
  if (threadIdx.x < R) {
    float v = 0.f;
    for (int s = 0; s < splits; ++s) v += partials[(t * splits + s) * R + threadIdx.x];
    xa[threadIdx.x] = v;
  }
  __syncthreads();
  const int64_t n = static_cast<int64_t>(blockIdx.y) * kExpandThreads + threadIdx.x;
  if (n >= N) return;
  const float* b = B + (slot * N + n) * R;  // the R values of column n, contiguous
  float acc = 0.f;
  if ((R & 3) == 0 && (reinterpret_cast<uintptr_t>(B) & 15) == 0) {  // 16-byte aligned rows: float4
    for (int r = 0; r < R; r += 4) {
      const float4 v = *reinterpret_cast<const float4*>(b + r);
      acc += xa[r] * v.x + xa[r + 1] * v.y + xa[r + 2] * v.z + xa[r + 3] * v.w;
    }
  } else {
    for (int r = 0; r < R; ++r) acc += xa[r] * b[r];
  }
  const int64_t at = t * N + n;
  loraq_store(y, at, loraq_load(y, at) + scale * acc);
}

template <typename T, int kR>
int launch_shrink(const T* x, int64_t T_, int64_t K, int64_t S, const float* A, const float* scales,
                  const int64_t* index, int64_t n_slots, int R, float* partials, int splits,
                  cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(T_), static_cast<unsigned>(splits));
  const bool vec = K % 8 == 0 && reinterpret_cast<uintptr_t>(x) % 16 == 0 &&
                   reinterpret_cast<uintptr_t>(A) % 16 == 0;
  if (vec)
    shrink_kernel<T, kR, true><<<grid, kShrinkThreads, 0, stream>>>(x, K, S, A, scales, index, n_slots, R,
                                                                    partials, splits);
  else
    shrink_kernel<T, kR, false><<<grid, kShrinkThreads, 0, stream>>>(x, K, S, A, scales, index, n_slots, R,
                                                                     partials, splits);
  return static_cast<int>(cudaGetLastError());
}

template <typename T>
int launch(T* y, const T* x, int64_t T_, int64_t S, int64_t K, int64_t N, const float* A, const float* B,
           const float* scales, const int64_t* index, int64_t n_slots, int R, float* partials,
           cudaStream_t stream) {
  const int splits = static_cast<int>((K + kShrinkChunk - 1) / kShrinkChunk);
  int rc;
  if (R <= 16)
    rc = launch_shrink<T, 16>(x, T_, K, S, A, scales, index, n_slots, R, partials, splits, stream);
  else if (R <= 32)
    rc = launch_shrink<T, 32>(x, T_, K, S, A, scales, index, n_slots, R, partials, splits, stream);
  else
    rc = launch_shrink<T, 64>(x, T_, K, S, A, scales, index, n_slots, R, partials, splits, stream);
  if (rc != 0) return rc;
  const dim3 grid(static_cast<unsigned>(T_), static_cast<unsigned>((N + kExpandThreads - 1) / kExpandThreads));
  expand_kernel<T><<<grid, kExpandThreads, 0, stream>>>(y, N, S, B, scales, index, n_slots, R, partials,
                                                        splits);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace

extern "C" {

// fp32 elements of the `partials` workspace loraq_lora_multi needs: T · splits(K) · R.
int64_t loraq_lora_multi_workspace(int64_t T, int64_t K, int R) {
  return T * ((K + kShrinkChunk - 1) / kShrinkChunk) * R;
}

// y (T, N) += the LoRA term of each token's slot (see the top of this file). x (T, K) and y are
// contiguous rows of `dtype`; A, B, scales contiguous fp32; index (T / S,) int64; R in 1..64;
// partials: loraq_lora_multi_workspace(T, K, R) fp32 elements.
int loraq_lora_multi(void* y, const void* x, int dtype, int64_t T, int64_t S, int64_t K, int64_t N,
                     const float* A, const float* B, const float* scales, const int64_t* index,
                     int64_t n_slots, int R, float* partials, cudaStream_t stream) {
  if (T == 0 || N == 0 || K == 0) return 0;
  if (R < 1 || R > kMaxRank || S < 1 || T % S != 0 || T > 2147483647LL ||
      (N + kExpandThreads - 1) / kExpandThreads > 65535 || (K + kShrinkChunk - 1) / kShrinkChunk > 65535)
    return static_cast<int>(cudaErrorInvalidValue);
  if (dtype == LORAQ_BF16)
    return launch<__nv_bfloat16>(static_cast<__nv_bfloat16*>(y), static_cast<const __nv_bfloat16*>(x), T, S,
                                 K, N, A, B, scales, index, n_slots, R, partials, stream);
  if (dtype == LORAQ_F32)
    return launch<float>(static_cast<float*>(y), static_cast<const float*>(x), T, S, K, N, A, B, scales,
                         index, n_slots, R, partials, stream);
  return static_cast<int>(cudaErrorInvalidValue);
}

}  // extern "C"
