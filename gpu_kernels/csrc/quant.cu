// Dequantize a tile of rows of a frozen NF4 or int8 weight straight into bf16, in one launch.
//
// The tiled dequantize-then-GEMM of gpu_kernels/quant/frozen.py calls this once per tile of rows
// (the whole weight never exists in bf16 at once). The torch reference of the same tile takes four
// launches and fp32 temporaries (index_select into fp32 pairs, the absmax product, the bf16 cast):
// about 16 bytes of traffic a weight against 2.5 here (0.5 read, 2 written). The values are the
// reference's bit for bit: the same fp32 products (no fused multiply-add), rounded to bf16 once.
//
//   NF4: ŵ = code[q] · a, q a 4-bit index (two a byte, high nibble first), a the absmax of the
//        weight's block of `block` weights; with double quantization a = c₂ · s[g] + mean, c₂ an
//        int8 code and s the scale of the group of 256 blocks it belongs to.
//   int8: ŵ = q · s_row.

#include "common.cuh"

namespace {

constexpr int kThreads = 256;
constexpr int kDqGroup = 256;  // blocks a double-quantization group (gpu_kernels/quant/nf4.py DQ_GROUP)

__constant__ float kNF4[16] = {
    -1.0f, -0.6961928009986877f, -0.5250730514526367f, -0.39491748809814453f,
    -0.28444138169288635f, -0.18477343022823334f, -0.09105003625154495f, 0.0f,
    0.07958029955625534f, 0.16093020141124725f, 0.24611230194568634f, 0.33791524171829224f,
    0.44070982933044434f, 0.5626170039176941f, 0.7229568362236023f, 1.0f};

// One thread dequantizes 8 weights (4 packed bytes) of one block. The 16 code values go to shared
// memory first: a constant-memory read of 16 different indices in a warp would be serialized.
__global__ void nf4_kernel(const uint32_t* __restrict__ packed, const float* __restrict__ absmax,
                           const int8_t* __restrict__ dq_codes, const float* __restrict__ dq_scale,
                           const float* __restrict__ dq_mean, int64_t first_block, int64_t n8,
                           int block, __nv_bfloat16* __restrict__ out) {
  __shared__ float code[16];
  if (threadIdx.x < 16) code[threadIdx.x] = kNF4[threadIdx.x];
  __syncthreads();
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n8) return;
  const int64_t b = i * 8 / block;  // the tile's block of these 8 weights
  float a;
  if (absmax != nullptr) {
    a = absmax[b];
  } else {  // the reference's fp32 ops in its order: code · scale, then + mean
    const int64_t g = first_block + b;
    a = __fadd_rn(__fmul_rn(static_cast<float>(dq_codes[g]), dq_scale[g / kDqGroup]), *dq_mean);
  }
  const uint32_t word = packed[i];  // bytes in memory order, little-endian: byte j at bits 8j
  float v[8];
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const uint32_t byte = (word >> (8 * j)) & 0xffu;
    v[2 * j] = __fmul_rn(code[byte >> 4], a);
    v[2 * j + 1] = __fmul_rn(code[byte & 0x0fu], a);
  }
  store8(out + i * 8, v);
}

// One thread dequantizes 8 int8 weights of one row.
__global__ void int8_kernel(const int8_t* __restrict__ codes, const float* __restrict__ scale,
                            int64_t n8, int64_t n_in, __nv_bfloat16* __restrict__ out) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n8) return;
  const float s = scale[i * 8 / n_in];
  const uint2 raw = *reinterpret_cast<const uint2*>(codes + i * 8);
  const int8_t* q = reinterpret_cast<const int8_t*>(&raw);
  float v[8];
#pragma unroll
  for (int j = 0; j < 8; ++j) v[j] = __fmul_rn(static_cast<float>(q[j]), s);
  store8(out + i * 8, v);
}

int blocks_for(int64_t n8) { return static_cast<int>((n8 + kThreads - 1) / kThreads); }

}  // namespace

// rows × n_in weights of an NF4 weight into out (rows, n_in) bf16. packed: the tile's (rows, n_in/2)
// bytes (4-byte aligned); absmax: its (rows, n_in/block) fp32, or null with double quantization,
// where dq_codes/dq_scale/dq_mean are the whole weight's and first_block the tile's first block.
extern "C" int loraq_nf4_dequant(const void* packed, const void* absmax, const void* dq_codes,
                                 const void* dq_scale, const void* dq_mean, int64_t first_block,
                                 int64_t rows, int64_t n_in, int block, void* out, void* stream) {
  if (rows <= 0 || n_in % 8 != 0 || block % 8 != 0) return static_cast<int>(cudaErrorInvalidValue);
  const int64_t n8 = rows * n_in / 8;
  nf4_kernel<<<blocks_for(n8), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      static_cast<const uint32_t*>(packed), static_cast<const float*>(absmax),
      static_cast<const int8_t*>(dq_codes), static_cast<const float*>(dq_scale),
      static_cast<const float*>(dq_mean), first_block, n8, block,
      static_cast<__nv_bfloat16*>(out));
  LORAQ_RETURN_LAST_ERROR;
}

// rows × n_in weights of an int8 weight (codes (rows, n_in), 8-byte aligned; scale (rows,) fp32)
// into out (rows, n_in) bf16.
extern "C" int loraq_int8_dequant(const void* codes, const void* scale, int64_t rows, int64_t n_in,
                                  void* out, void* stream) {
  if (rows <= 0 || n_in % 8 != 0) return static_cast<int>(cudaErrorInvalidValue);
  const int64_t n8 = rows * n_in / 8;
  int8_kernel<<<blocks_for(n8), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      static_cast<const int8_t*>(codes), static_cast<const float*>(scale), n8, n_in,
      static_cast<__nv_bfloat16*>(out));
  LORAQ_RETURN_LAST_ERROR;
}
