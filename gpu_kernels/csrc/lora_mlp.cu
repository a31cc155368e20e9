// The gated MLP's backward with the LoRA reductions of its two projections folded in, for bf16
// activations and rank-16 adapters (gpu_kernels/ops/lora_mlp.py pads smaller ranks with zeros).
//
// The MLP is y = down(h), h = act(g) ⊙ u, [g | u] = gate_up(x), with LoRA on gate, up and down.
// Unfused, its backward reads the (M, 2F) gradient dgu three times (the base dX GEMM, then the
// gate/up LoRA's U = dgu·Dᵀ and G = dguᵀ·xa) and the saved (M, F) h once more (down's
// dA = U_downᵀ·h). This kernel forms dgu from dh and [g | u] and, while the tile is on chip,
// also forms those three reductions, so dgu is read once more (by the base GEMM) and h is never
// saved: the forward frees it.
//
// Inputs   dh (M, F) contiguous; gu (M, 2F) = [g | u]; ud (M, 16) = U of down = dY·D_downᵀ;
//          dlu (32, 2F) = D of gate/up = blockdiag(s_g·B_gᵀ, s_u·B_uᵀ) (only the diagonal blocks
//          are read); xa (M, 32) = [x·A_gᵀ | x·A_uᵀ] saved by the forward.
// Outputs  dgu (M, 2F) bf16 = [dh ⊙ u ⊙ act'(g) | dh ⊙ act(g)];
//          uacc (M, 32) fp32  += [dg·D_gᵀ | du·D_uᵀ]        (gate/up LoRA's U)
//          gacc (2F, 16) fp32 += [dgᵀ·xa_g ; duᵀ·xa_u]      (dB_g / s_g and dB_u / s_u)
//          daacc (16, F) fp32 += udᵀ·h                      (down's dA)
//          the fp32 outputs must be zero on entry (atomic accumulation).
//
// Work split: a block owns 256 columns of F (kWarps = 8 warps × 32) and a group of rows, walked in tiles of
// 32 rows. Per tile each warp forms its 32×32 h, dg and du (bf16, in shared memory), then runs the
// three skinny products on the tensor cores (WMMA 16×16×16, fp32 accumulators). U sums over
// columns: the warps' partials are added in shared memory and the block's sum goes to uacc with
// one vector atomic per 4 values. G and dA sum over rows: their accumulators stay in registers
// for the block's whole row group and are added to gacc / daacc once at the end. The row group is
// sized so the grid is one wave: fewer atomics and no tail wave.

#include <mma.h>

#include "common.cuh"
#include "glu_act.cuh"

namespace {

using namespace nvcuda;

constexpr int kRank = 16;         // every adapter's rank (one WMMA tile)
constexpr int kTileM = 32;        // rows per tile
constexpr int kWarpF = 32;        // columns of F per warp
constexpr int kLdT = kWarpF + 8;  // bf16 row stride of a warp tile (80 B: staggers the banks)

using Frag16A_row = wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major>;
using Frag16A_col = wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::col_major>;
using Frag16B_row = wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::row_major>;
using Frag16B_col = wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::col_major>;
using Acc = wmma::fragment<wmma::accumulator, 16, 16, 16, float>;

template <int kWarps>
struct Smem {
  static constexpr int kBlockF = kWarps * kWarpF;
  static constexpr int kLdD = kBlockF + 8;
  // per warp: h, dg, du of its 32×32 tile; after the warp's products its first 4 KB hold its
  // (32 rows × 32) fp32 U partial [gate 16 | up 16]
  __nv_bfloat16 tile[kWarps][3][kTileM * kLdT];
  __nv_bfloat16 d[2 * kRank][kLdD];  // the block's columns of D_g (rows 0-15) and D_u (16-31)
  __nv_bfloat16 ud[kTileM * kRank];  // (32, 16)
  __nv_bfloat16 xa[kTileM * 2 * kRank];  // (32, 32)
};

__device__ __forceinline__ void add4(float* p, float a, float b, float c, float d) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  atomicAdd(reinterpret_cast<float4*>(p), make_float4(a, b, c, d));
#else
  atomicAdd(p, a);
  atomicAdd(p + 1, b);
  atomicAdd(p + 2, c);
  atomicAdd(p + 3, d);
#endif
}

// 16 warps resident per SM (two blocks of 8, four of 4): at most 128 registers a thread
template <int kAct, int kWarps>
__global__ void __launch_bounds__(kWarps * 32, 16 / kWarps) glu_bwd_lora_kernel(
    const __nv_bfloat16* __restrict__ dh, const __nv_bfloat16* __restrict__ gu,
    const __nv_bfloat16* __restrict__ ud, const __nv_bfloat16* __restrict__ dlu,
    const __nv_bfloat16* __restrict__ xa, __nv_bfloat16* __restrict__ dgu, float* __restrict__ uacc,
    float* __restrict__ gacc, float* __restrict__ daacc, int64_t M, int64_t F, int64_t rows_per_block) {
  extern __shared__ __align__(128) unsigned char smem_raw[];
  using S = Smem<kWarps>;
  constexpr int kThreads = kWarps * 32, kBlockF = S::kBlockF, kLdD = S::kLdD;
  S& s = *reinterpret_cast<S*>(smem_raw);
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int64_t F2 = 2 * F;
  const int64_t col0 = static_cast<int64_t>(blockIdx.x) * kBlockF;  // first column of F
  const int64_t row_begin = static_cast<int64_t>(blockIdx.y) * rows_per_block;
  const int64_t row_end = min(M, row_begin + rows_per_block);

  // the block's 256 columns of the diagonal blocks of D, zero past F
  for (int i = tid; i < 2 * kRank * (kBlockF / 8); i += kThreads) {
    const int r = i / (kBlockF / 8), c = (i % (kBlockF / 8)) * 8;
    const int64_t f = col0 + c;
    uint4 v = make_uint4(0, 0, 0, 0);
    if (f < F) v = *reinterpret_cast<const uint4*>(dlu + r * F2 + (r < kRank ? 0 : F) + f);
    *reinterpret_cast<uint4*>(&s.d[r][c]) = v;
  }

  Acc acc_da[2], acc_gg[2], acc_gu[2];  // dA (16 r × 16 f) and G (16 f × 16 r) of the warp's 2 column frags
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    wmma::fill_fragment(acc_da[j], 0.f);
    wmma::fill_fragment(acc_gg[j], 0.f);
    wmma::fill_fragment(acc_gu[j], 0.f);
  }
  __nv_bfloat16* th = s.tile[warp][0];
  __nv_bfloat16* tdg = s.tile[warp][1];
  __nv_bfloat16* tdu = s.tile[warp][2];
  float* red = reinterpret_cast<float*>(s.tile[warp][0]);  // (32, 32) fp32, after the products
  const int64_t wcol = col0 + warp * kWarpF;                 // the warp's first column of F

  for (int64_t m0 = row_begin; m0 < row_end; m0 += kTileM) {
    // ud (32×16) and xa (32×32) rows of the tile, zero past M: 64 + 128 16-byte vectors
    for (int q = tid; q < 192; q += kThreads) {
      if (q < 64) {
        const int r = q >> 1, c = (q & 1) * 8;
        uint4 v = make_uint4(0, 0, 0, 0);
        if (m0 + r < M) v = *reinterpret_cast<const uint4*>(ud + (m0 + r) * kRank + c);
        *reinterpret_cast<uint4*>(&s.ud[r * kRank + c]) = v;
      } else {
        const int i = q - 64, r = i >> 2, c = (i & 3) * 8;
        uint4 v = make_uint4(0, 0, 0, 0);
        if (m0 + r < M) v = *reinterpret_cast<const uint4*>(xa + (m0 + r) * 2 * kRank + c);
        *reinterpret_cast<uint4*>(&s.xa[r * 2 * kRank + c]) = v;
      }
    }

    // the warp's 32×32 elementwise tile: lane owns 8 columns of rows lane/4 + 8i, i < 4;
    // rows past M and columns past F are zeros (they add nothing to any product)
    {
      const int c = (lane & 3) * 8;
      const int64_t f = wcol + c;
      uint4 dv[4], gv[4], uv[4];  // raw bf16 vectors: all 12 loads in flight before any math
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int64_t m = m0 + (lane >> 2) + 8 * i;
        dv[i] = gv[i] = uv[i] = make_uint4(0, 0, 0, 0);
        if (m < M && f < F) {
          dv[i] = *reinterpret_cast<const uint4*>(dh + m * F + f);
          gv[i] = *reinterpret_cast<const uint4*>(gu + m * F2 + f);
          uv[i] = *reinterpret_cast<const uint4*>(gu + m * F2 + F + f);
        }
      }
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int r = (lane >> 2) + 8 * i;
        const int64_t m = m0 + r;
        float d8[8], g8[8], u8[8], hv[8], dgv[8], duv[8];
        unpack8(dv[i], d8);
        unpack8(gv[i], g8);
        unpack8(uv[i], u8);
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          float a, da;
          glu::act_fwd_grad<kAct>(g8[j], a, da);
          hv[j] = a * u8[j];
          dgv[j] = d8[j] * u8[j] * da;
          duv[j] = d8[j] * a;
        }
        if (m < M && f < F) {
          store8(dgu + m * F2 + f, dgv);
          store8(dgu + m * F2 + F + f, duv);
        }
        store8(th + r * kLdT + c, hv);
        store8(tdg + r * kLdT + c, dgv);
        store8(tdu + r * kLdT + c, duv);
      }
    }
    __syncthreads();  // ud / xa staged; the warp's tiles written

    Acc acc_u[2][2];  // [row frag][gate, up]: U partial over the warp's 32 columns
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      wmma::fill_fragment(acc_u[i][0], 0.f);
      wmma::fill_fragment(acc_u[i][1], 0.f);
    }
#pragma unroll
    for (int k = 0; k < 2; ++k) {  // 16-row (for dA, G) or 16-column (for U) steps
      Frag16A_col a_ud;  // udᵀ: (16 r × 16 rows)
      wmma::load_matrix_sync(a_ud, s.ud + 16 * k * kRank, kRank);
      Frag16B_row b_xg, b_xu;  // xa rows (16 rows × 16 r) of gate and up
      wmma::load_matrix_sync(b_xg, s.xa + 16 * k * 2 * kRank, 2 * kRank);
      wmma::load_matrix_sync(b_xu, s.xa + 16 * k * 2 * kRank + kRank, 2 * kRank);
      Frag16B_col b_dg, b_du;  // D_gᵀ, D_uᵀ over the warp's columns 16k..16k+15: (16 f × 16 r)
      wmma::load_matrix_sync(b_dg, &s.d[0][warp * kWarpF + 16 * k], kLdD);
      wmma::load_matrix_sync(b_du, &s.d[kRank][warp * kWarpF + 16 * k], kLdD);
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        // dA[:, cols j] += udᵀ(rows k) · h(rows k, cols j)
        Frag16B_row b_h;
        wmma::load_matrix_sync(b_h, th + 16 * k * kLdT + 16 * j, kLdT);
        wmma::mma_sync(acc_da[j], a_ud, b_h, acc_da[j]);
        // G[cols j] += dgᵀ(cols j, rows k) · xa(rows k)
        Frag16A_col a_dgt, a_dut;
        wmma::load_matrix_sync(a_dgt, tdg + 16 * k * kLdT + 16 * j, kLdT);
        wmma::load_matrix_sync(a_dut, tdu + 16 * k * kLdT + 16 * j, kLdT);
        wmma::mma_sync(acc_gg[j], a_dgt, b_xg, acc_gg[j]);
        wmma::mma_sync(acc_gu[j], a_dut, b_xu, acc_gu[j]);
        // U[rows j] += dg(rows j, cols k) · D_gᵀ(cols k)   (here j walks rows, k columns)
        Frag16A_row a_dg, a_du;
        wmma::load_matrix_sync(a_dg, tdg + 16 * j * kLdT + 16 * k, kLdT);
        wmma::load_matrix_sync(a_du, tdu + 16 * j * kLdT + 16 * k, kLdT);
        wmma::mma_sync(acc_u[j][0], a_dg, b_dg, acc_u[j][0]);
        wmma::mma_sync(acc_u[j][1], a_du, b_du, acc_u[j][1]);
      }
    }
    __syncwarp();  // the warp's tiles are read: its U partial may overwrite them
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      wmma::store_matrix_sync(red + 16 * i * 32, acc_u[i][0], 32, wmma::mem_row_major);
      wmma::store_matrix_sync(red + 16 * i * 32 + kRank, acc_u[i][1], 32, wmma::mem_row_major);
    }
    __syncthreads();
    // the block's U: each thread sums groups of 4 consecutive values of the (32, 32) tile over the warps
    for (int e = tid * 4; e < kTileM * 2 * kRank; e += kThreads * 4) {
      const int r = e >> 5, c = e & 31;
      float v[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
      for (int w = 0; w < kWarps; ++w) {
        const float4 p = *reinterpret_cast<const float4*>(reinterpret_cast<float*>(s.tile[w][0]) + e);
        v[0] += p.x;
        v[1] += p.y;
        v[2] += p.z;
        v[3] += p.w;
      }
      if (m0 + r < M) add4(uacc + (m0 + r) * 2 * kRank + c, v[0], v[1], v[2], v[3]);
    }
    __syncthreads();  // every warp's partial is read before the next tile overwrites it
  }

  // the row group's G and dA: through the warp's own shared memory, 4 values per atomic
  float* out = reinterpret_cast<float*>(s.tile[warp][0]);  // 3 × 2 frags × 256 floats = 6 KB
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    wmma::store_matrix_sync(out + j * 256, acc_da[j], 16, wmma::mem_row_major);        // [r][f]
    wmma::store_matrix_sync(out + 512 + j * 256, acc_gg[j], 16, wmma::mem_row_major);  // [f][r]
    wmma::store_matrix_sync(out + 1024 + j * 256, acc_gu[j], 16, wmma::mem_row_major);
  }
  __syncwarp();
  for (int q = lane; q < 3 * 2 * 64; q += 32) {  // 384 groups of 4 floats
    const int which = q / 128, j = (q / 64) & 1, e = (q & 63) * 4, r = e >> 4, c = e & 15;
    const float* p = out + which * 512 + j * 256 + e;
    const int64_t fj = wcol + 16 * j;
    if (which == 0) {  // dA: row r = rank, columns c..c+3 of frag j
      if (fj + c < F) add4(daacc + r * F + fj + c, p[0], p[1], p[2], p[3]);
    } else {           // G: row r = column f of frag j, c..c+3 = ranks
      const int64_t f = fj + r;
      if (f < F) add4(gacc + ((which == 1 ? 0 : F) + f) * kRank + c, p[0], p[1], p[2], p[3]);
    }
  }
}

// Blocks resident per SM and SM count of the current device, read once per device.
struct Occupancy {
  int device = -1, sms = 0, per_sm = 0;
};

template <int kAct, int kWarps>
int launch(const __nv_bfloat16* dh, const __nv_bfloat16* gu, const __nv_bfloat16* ud,
           const __nv_bfloat16* dlu, const __nv_bfloat16* xa, __nv_bfloat16* dgu, float* uacc,
           float* gacc, float* daacc, int64_t M, int64_t F, cudaStream_t stream) {
  static Occupancy occ[16];
  int dev = 0;
  cudaGetDevice(&dev);
  Occupancy& o = occ[dev & 15];
  constexpr int kThreads = kWarps * 32;
  const int smem = static_cast<int>(sizeof(Smem<kWarps>));
  if (o.device != dev) {
    cudaFuncSetAttribute(glu_bwd_lora_kernel<kAct, kWarps>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    cudaDeviceGetAttribute(&o.sms, cudaDevAttrMultiProcessorCount, dev);
    cudaOccupancyMaxActiveBlocksPerMultiprocessor(&o.per_sm, glu_bwd_lora_kernel<kAct, kWarps>, kThreads, smem);
    o.device = dev;
  }
  const int64_t col_blocks = (F + Smem<kWarps>::kBlockF - 1) / Smem<kWarps>::kBlockF;
  const int64_t resident = static_cast<int64_t>(o.sms) * (o.per_sm > 0 ? o.per_sm : 1);
  const int64_t tiles = (M + kTileM - 1) / kTileM;
  // row groups so that the grid fills one wave (at least one group; tiles split evenly)
  int64_t groups = resident / col_blocks;
  if (groups < 1) groups = 1;
  if (groups > tiles) groups = tiles;
  const int64_t rows_per_block = ((tiles + groups - 1) / groups) * kTileM;
  groups = (M + rows_per_block - 1) / rows_per_block;
  if (col_blocks > 2147483647LL || groups > 65535) return static_cast<int>(cudaErrorInvalidValue);
  const dim3 grid(static_cast<unsigned>(col_blocks), static_cast<unsigned>(groups));
  glu_bwd_lora_kernel<kAct, kWarps><<<grid, kThreads, smem, stream>>>(dh, gu, ud, dlu, xa, dgu, uacc, gacc,
                                                                      daacc, M, F, rows_per_block);
  LORAQ_RETURN_LAST_ERROR;
}

}  // namespace

extern "C" {

// See the file comment. bf16 only, every tensor contiguous and 16-byte aligned, F % 8 == 0;
// uacc, gacc and daacc zeroed by the caller. act: 0 SiLU, 1 tanh-GELU.
int loraq_glu_bwd_lora(const void* dh, const void* gu, const void* ud, const void* dlu, const void* xa,
                       void* dgu, float* uacc, float* gacc, float* daacc, int64_t M, int64_t F, int act,
                       cudaStream_t stream) {
  if (M == 0 || F == 0) return 0;
  if (F % 8 != 0 || (act != glu::kSiLU && act != glu::kGeluTanh)) return static_cast<int>(cudaErrorInvalidValue);
  if (!(aligned16(dh) && aligned16(gu) && aligned16(ud) && aligned16(dlu) && aligned16(xa) && aligned16(dgu) &&
        aligned16(uacc) && aligned16(gacc) && aligned16(daacc)))
    return static_cast<int>(cudaErrorMisalignedAddress);
  using B = __nv_bfloat16;
  const auto* a = static_cast<const B*>(dh);
  const auto* g = static_cast<const B*>(gu);
  const auto* u = static_cast<const B*>(ud);
  const auto* d = static_cast<const B*>(dlu);
  const auto* x = static_cast<const B*>(xa);
  auto* o = static_cast<B*>(dgu);
  // 8 warps a block: on an H100, blocks of 4 (four a SM) were no faster (bench/results/mlp-h100-2026-12-07-warps.json)
  if (act == glu::kSiLU) return launch<glu::kSiLU, 8>(a, g, u, d, x, o, uacc, gacc, daacc, M, F, stream);
  return launch<glu::kGeluTanh, 8>(a, g, u, d, x, o, uacc, gacc, daacc, M, F, stream);
}

}  // extern "C"
