// Shared helpers for Loraq's kernels: plain CUDA runtime only (no ATen/c10 headers, so the
// sources compile with nvcc alone on a machine without a CUDA build of torch).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>

// dtype codes shared with gpu_kernels/_lib.py
#define LORAQ_F32 0
#define LORAQ_BF16 1

__device__ __forceinline__ float loraq_load(const float* p, int64_t i) { return p[i]; }
__device__ __forceinline__ float loraq_load(const __nv_bfloat16* p, int64_t i) {
  return __bfloat162float(p[i]);
}
__device__ __forceinline__ void loraq_store(float* p, int64_t i, float v) { p[i] = v; }
__device__ __forceinline__ void loraq_store(__nv_bfloat16* p, int64_t i, float v) {
  p[i] = __float2bfloat16(v);
}

// 8 consecutive elements as fp32, moved as 16-byte (bf16) or 2x16-byte (fp32) vectors; the
// pointer must be 16-byte aligned.
// 8 bf16 values already loaded as one 16-byte vector, as fp32
__device__ __forceinline__ void unpack8(const uint4& raw, float (&v)[8]) {
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __bfloat1622float2(h[i]);
    v[2 * i] = f.x;
    v[2 * i + 1] = f.y;
  }
}
__device__ __forceinline__ void load8(const __nv_bfloat16* p, float (&v)[8]) {
  unpack8(*reinterpret_cast<const uint4*>(p), v);
}
__device__ __forceinline__ void store8(__nv_bfloat16* p, const float (&v)[8]) {
  uint4 raw;
  __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&raw);
#pragma unroll
  for (int i = 0; i < 4; ++i) h[i] = __floats2bfloat162_rn(v[2 * i], v[2 * i + 1]);
  *reinterpret_cast<uint4*>(p) = raw;
}
__device__ __forceinline__ void load8(const float* p, float (&v)[8]) {
  const float4 a = *reinterpret_cast<const float4*>(p);
  const float4 b = *reinterpret_cast<const float4*>(p + 4);
  v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w;
  v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
}
__device__ __forceinline__ void store8(float* p, const float (&v)[8]) {
  *reinterpret_cast<float4*>(p) = make_float4(v[0], v[1], v[2], v[3]);
  *reinterpret_cast<float4*>(p + 4) = make_float4(v[4], v[5], v[6], v[7]);
}

// 4 consecutive elements as fp32, moved as one 8-byte (bf16) or 16-byte (fp32) vector; the
// pointer must be aligned to that size.
__device__ __forceinline__ void load4(const __nv_bfloat16* p, float (&v)[4]) {
  const uint2 raw = *reinterpret_cast<const uint2*>(p);
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&raw);
  const float2 a = __bfloat1622float2(h[0]), b = __bfloat1622float2(h[1]);
  v[0] = a.x; v[1] = a.y; v[2] = b.x; v[3] = b.y;
}
__device__ __forceinline__ void store4(__nv_bfloat16* p, const float (&v)[4]) {
  uint2 raw;
  __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&raw);
  h[0] = __floats2bfloat162_rn(v[0], v[1]);
  h[1] = __floats2bfloat162_rn(v[2], v[3]);
  *reinterpret_cast<uint2*>(p) = raw;
}
__device__ __forceinline__ void load4(const float* p, float (&v)[4]) {
  const float4 a = *reinterpret_cast<const float4*>(p);
  v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w;
}
__device__ __forceinline__ void store4(float* p, const float (&v)[4]) {
  *reinterpret_cast<float4*>(p) = make_float4(v[0], v[1], v[2], v[3]);
}

// Whether a pointer is 16-byte aligned: the vectorized (uint4) paths need it.
inline bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// Threads for a block that gives each of `work` items (a row's vectors, a token's rotation pairs)
// its own thread: the multiple of 32 at or above `work`, between 64 and `max_threads` (more work
// loops). A power of two would leave up to half of them idle and cap the rows resident per SM:
// 256 threads for the 144 vectors of Gemma-3-1B's 1,152-wide rows, where 160 cover them.
inline int loraq_threads_for(int64_t work, int max_threads) {
  const int64_t t = (work + 31) / 32 * 32;
  return t < 64 ? 64 : (t > max_threads ? max_threads : static_cast<int>(t));
}

// Threads for a block that normalises rows of D: one per 8 elements when vectorized, else per 4
// (past 1,024 threads each loops over the row).
inline int loraq_row_threads(int64_t D, bool vec) {
  return loraq_threads_for(vec ? (D + 7) / 8 : (D + 3) / 4, 1024);
}

// Sum over a block of blockDim.x threads (a multiple of 32, at most 1024). Every thread gets
// the total. `scratch` holds 32 floats of shared memory.
__device__ __forceinline__ float loraq_block_sum(float v, float* scratch) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  __syncthreads();  // scratch may still be read by a previous call
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  const int n_warps = (blockDim.x + 31) >> 5;
  v = lane < n_warps ? scratch[lane] : 0.f;
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ float loraq_block_max(float v, float* scratch) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  const int n_warps = (blockDim.x + 31) >> 5;
  v = lane < n_warps ? scratch[lane] : -INFINITY;
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Launchers return cudaGetLastError() as an int so the Python side can raise with its name.
#define LORAQ_RETURN_LAST_ERROR return static_cast<int>(cudaGetLastError())
