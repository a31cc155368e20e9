// Fused LoRA pieces around the base GEMM (which cuBLAS does, called from torch):
//
//   forward   y  (M, N) += s · xa (M, r) · Bᵀ        xa = drop(x)·Aᵀ, B (N, r)
//   backward  dX (M, K) += (s·dY·B) (M, r) · A      A (r, K)
//
// Both are the same rank-r update `out += scale · U · V` (V = Bᵀ or A, row-major), done in
// place on the base GEMM's output: the LoRA term never exists as a full (M, N) temporary.
// U (M, r) has out's dtype (it comes from the skinny bf16 GEMMs, as under PEFT's autocast), V is
// fp32 (the adapters are fp32 masters); the sum is taken in fp32 and rounded once into `out`.
//
// Dropout on the LoRA input uses a counter-based hash of (seed, salt, element index), so the
// backward regenerates the same mask without storing it, and a CUDA graph can replay it with a
// new seed read from device memory every step.

#include "common.cuh"

namespace {

// The rank update is memory-bound only if the FMAs cost little beside them: each thread keeps
// its 4 columns of V (R ≤ 16 per launch, 64 registers) for a whole block of rows, so every V
// value is read once per thread and used for every row; the rows' U values come from shared
// memory as broadcasts (4 x 16-byte reads per row). A warp moves 4 rows of `out` per round
// (8 bytes a lane, 256 contiguous bytes a warp), loads first, so 4 loads are in flight.
constexpr int kRankPerLaunch = 16;   // the host splits larger R into several launches
constexpr int kColsPerThread = 4;
constexpr int kBlockCols = 32 * kColsPerThread;  // 128 columns per block
constexpr int kWarps = 8;
constexpr int kUnroll = 4;

// out[m, n] += scale · Σ_{r<R} U[m·ldu + r] · V[r·ldv + n], R ≤ 16. Block: 128 columns x
// rows_per_block rows. kVec: out rows aligned for 4-element vectors and ld_out % 4 == 0.
template <typename T, bool kVec>
__global__ void __launch_bounds__(256) rank_update_kernel(T* __restrict__ out, int64_t ld_out, int64_t M,
                                                          int64_t N, const T* __restrict__ U, int64_t ldu,
                                                          const float* __restrict__ V, int64_t ldv, int R,
                                                          float scale, int rows_per_block) {
  extern __shared__ __align__(16) float Us[];  // (rows_per_block, 16), zero where r >= R
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int64_t n = static_cast<int64_t>(blockIdx.x) * kBlockCols + lane * kColsPerThread;
  const int64_t m0 = static_cast<int64_t>(blockIdx.y) * rows_per_block;
  for (int i = tid; i < rows_per_block * kRankPerLaunch; i += blockDim.x) {
    const int row = i / kRankPerLaunch, r = i % kRankPerLaunch;
    const int64_t m = m0 + row;
    Us[i] = (r < R && m < M) ? loraq_load(U, m * ldu + r) : 0.f;
  }
  float v[kRankPerLaunch][kColsPerThread];
#pragma unroll
  for (int r = 0; r < kRankPerLaunch; ++r)
#pragma unroll
    for (int c = 0; c < kColsPerThread; ++c) v[r][c] = (r < R && n + c < N) ? V[r * ldv + n + c] : 0.f;
  __syncthreads();
  if (n >= N) return;
  const bool full = kVec && n + kColsPerThread <= N;
  const int rows_here = static_cast<int>(min(static_cast<int64_t>(rows_per_block), M - m0));
  for (int k0 = warp; k0 < rows_here; k0 += kWarps * kUnroll) {
    float o[kUnroll][kColsPerThread];
#pragma unroll
    for (int q = 0; q < kUnroll; ++q) {
      const int row = k0 + q * kWarps;
      const T* p = out + (m0 + row) * ld_out + n;
      if (row < rows_here && full) {
        load4(p, o[q]);
      } else {
#pragma unroll
        for (int c = 0; c < kColsPerThread; ++c)
          o[q][c] = (row < rows_here && n + c < N) ? loraq_load(p, c) : 0.f;
      }
    }
#pragma unroll
    for (int q = 0; q < kUnroll; ++q) {
      const int row = k0 + q * kWarps;
      if (row >= rows_here) break;
      float u[kRankPerLaunch];
#pragma unroll
      for (int r4 = 0; r4 < kRankPerLaunch / 4; ++r4) {
        const float4 t = *reinterpret_cast<const float4*>(&Us[row * kRankPerLaunch + 4 * r4]);
        u[4 * r4] = t.x; u[4 * r4 + 1] = t.y; u[4 * r4 + 2] = t.z; u[4 * r4 + 3] = t.w;
      }
      float acc[kColsPerThread] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
      for (int r = 0; r < kRankPerLaunch; ++r)
#pragma unroll
        for (int c = 0; c < kColsPerThread; ++c) acc[c] += u[r] * v[r][c];
#pragma unroll
      for (int c = 0; c < kColsPerThread; ++c) o[q][c] += scale * acc[c];
      T* p = out + (m0 + row) * ld_out + n;
      if (full) {
        store4(p, o[q]);
      } else {
#pragma unroll
        for (int c = 0; c < kColsPerThread; ++c)
          if (n + c < N) loraq_store(p, c, o[q][c]);
      }
    }
  }
}

int sm_count() {
  static int count = 0;  // read once, on the first (eager) call
  if (count == 0) {
    int device = 0;
    if (cudaGetDevice(&device) != cudaSuccess ||
        cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device) != cudaSuccess)
      count = 132;
  }
  return count;
}

template <typename T, bool kVec>
int launch_rank_update(T* out, int64_t ld_out, int64_t M, int64_t N, const T* U, int64_t ldu,
                       const float* V, int64_t ldv, int R, float scale, cudaStream_t stream) {
  const int64_t col_blocks = (N + kBlockCols - 1) / kBlockCols;
  // the tallest row block that still gives every SM a few blocks (fewer reloads of V)
  int rows = 256;
  while (rows > 32 && col_blocks * ((M + rows - 1) / rows) < 4LL * sm_count()) rows /= 2;
  const int64_t row_blocks = (M + rows - 1) / rows;
  if (row_blocks > 65535) return static_cast<int>(cudaErrorInvalidValue);
  const dim3 grid(static_cast<unsigned>(col_blocks), static_cast<unsigned>(row_blocks));
  const size_t smem = sizeof(float) * rows * kRankPerLaunch;
  rank_update_kernel<T, kVec><<<grid, kWarps * 32, smem, stream>>>(out, ld_out, M, N, U, ldu, V, ldv, R, scale, rows);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace

namespace {

__device__ __forceinline__ uint32_t hash32(uint32_t x) {
  // "lowbias32" integer hash (Wellons); mirrored exactly in reference.dropout_mask
  x ^= x >> 16;
  x *= 0x7feb352dU;
  x ^= x >> 15;
  x *= 0x846ca68bU;
  x ^= x >> 16;
  return x;
}

template <typename T>
__global__ void dropout_kernel(const T* __restrict__ x, T* __restrict__ out, int64_t n, float p,
                               const int64_t* __restrict__ seed, uint32_t salt) {
  const uint32_t key = hash32(static_cast<uint32_t>(*seed) ^ hash32(salt));
  const uint32_t threshold = static_cast<uint32_t>(p * 16777216.f);  // p · 2^24
  const float keep_scale = 1.f / (1.f - p);
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const uint32_t h = hash32(static_cast<uint32_t>(i) ^ key);
    const bool keep = (h >> 8) >= threshold;
    loraq_store(out, i, keep ? loraq_load(x, i) * keep_scale : 0.f);
  }
}

// One entry of loraq_adapter_cast's table, kCastFields int64 each: src (fp32, rows x cols,
// row-major), dst, rows, cols, dst row stride (elements), scale (fp32 bits), transpose.
constexpr int kCastFields = 7;

// dst[i·ld + j] = scale·src[i·cols + j] (transpose 0) or dst[j·ld + i] = scale·src[i·cols + j]
// (transpose 1), in the destination dtype; blockIdx.y picks the entry, the x blocks stride over
// its elements.
template <typename T>
__global__ void adapter_cast_kernel(const int64_t* __restrict__ table) {
  const int64_t* e = table + static_cast<int64_t>(blockIdx.y) * kCastFields;
  const float* src = reinterpret_cast<const float*>(e[0]);
  T* dst = reinterpret_cast<T*>(e[1]);
  const int64_t cols = e[3], ld = e[4], total = e[2] * e[3];
  const float scale = __int_as_float(static_cast<int>(e[5]));
  const bool transpose = e[6] != 0;
  for (int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; idx < total;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t i = idx / cols, j = idx - i * cols;
    loraq_store(dst, transpose ? j * ld + i : i * ld + j, scale * src[idx]);
  }
}

int grid_for(int64_t n, int threads) {
  const int64_t blocks = (n + threads - 1) / threads;
  return static_cast<int>(blocks < 65536 ? (blocks > 0 ? blocks : 1) : 65536);
}

}  // namespace

extern "C" {

// out[m, n] += scale · Σ_r U[m·ldu + r] · V[r·ldv + n]   for m < M, n < N; R ≤ 16.
// U has out's dtype; V is fp32.
int loraq_rank_update(void* out, int out_dtype, int64_t ld_out, int64_t M, int64_t N,
                      const void* U, int64_t ldu, const float* V, int64_t ldv, int R, float scale,
                      cudaStream_t stream) {
  if (M == 0 || N == 0 || R == 0) return 0;
  if (R > kRankPerLaunch) return static_cast<int>(cudaErrorInvalidValue);
  const int elt = out_dtype == LORAQ_BF16 ? 2 : 4;
  const bool vec = (reinterpret_cast<uintptr_t>(out) % (4 * elt) == 0) && (ld_out % 4 == 0);
  if (out_dtype == LORAQ_BF16) {
    auto* o = static_cast<__nv_bfloat16*>(out);
    auto* u = static_cast<const __nv_bfloat16*>(U);
    return vec ? launch_rank_update<__nv_bfloat16, true>(o, ld_out, M, N, u, ldu, V, ldv, R, scale, stream)
               : launch_rank_update<__nv_bfloat16, false>(o, ld_out, M, N, u, ldu, V, ldv, R, scale, stream);
  }
  if (out_dtype == LORAQ_F32) {
    auto* o = static_cast<float*>(out);
    auto* u = static_cast<const float*>(U);
    return vec ? launch_rank_update<float, true>(o, ld_out, M, N, u, ldu, V, ldv, R, scale, stream)
               : launch_rank_update<float, false>(o, ld_out, M, N, u, ldu, V, ldv, R, scale, stream);
  }
  return static_cast<int>(cudaErrorInvalidValue);
}

// out[i] = keep(seed, salt, i) ? x[i] / (1 - p) : 0, for contiguous x and out of n elements.
int loraq_dropout(const void* x, void* out, int dtype, int64_t n, float p, const int64_t* seed,
                  uint32_t salt, cudaStream_t stream) {
  if (n == 0) return 0;
  const int threads = 256;
  if (dtype == LORAQ_BF16) {
    dropout_kernel<__nv_bfloat16><<<grid_for(n, threads), threads, 0, stream>>>(
        static_cast<const __nv_bfloat16*>(x), static_cast<__nv_bfloat16*>(out), n, p, seed, salt);
  } else if (dtype == LORAQ_F32) {
    dropout_kernel<float><<<grid_for(n, threads), threads, 0, stream>>>(
        static_cast<const float*>(x), static_cast<float*>(out), n, p, seed, salt);
  } else {
    return static_cast<int>(cudaErrorInvalidValue);
  }
  LORAQ_RETURN_LAST_ERROR;
}

// The activation-dtype operands of many LoRA factors in one launch: table (device, n_entries x
// kCastFields int64, see adapter_cast_kernel), max_elems the largest rows·cols of an entry.
int loraq_adapter_cast(const int64_t* table, int n_entries, int64_t max_elems, int dst_dtype,
                       cudaStream_t stream) {
  if (n_entries == 0 || max_elems == 0) return 0;
  if (n_entries > 65535) return static_cast<int>(cudaErrorInvalidValue);
  const int threads = 256;
  const int64_t per_entry = (max_elems + threads - 1) / threads;
  const dim3 grid(static_cast<unsigned>(per_entry < 16 ? per_entry : 16), static_cast<unsigned>(n_entries));
  if (dst_dtype == LORAQ_BF16) {
    adapter_cast_kernel<__nv_bfloat16><<<grid, threads, 0, stream>>>(table);
  } else if (dst_dtype == LORAQ_F32) {
    adapter_cast_kernel<float><<<grid, threads, 0, stream>>>(table);
  } else {
    return static_cast<int>(cudaErrorInvalidValue);
  }
  LORAQ_RETURN_LAST_ERROR;
}

}  // extern "C"

extern "C" {

// Name of a CUDA error code returned by the launchers, for the Python side's messages.
const char* loraq_error_string(int code) { return cudaGetErrorString(static_cast<cudaError_t>(code)); }

}  // extern "C"
