// Cross-entropy forward and its gradient in one pass over a chunk of logits, in place.
//
// For each row i of logits (n, V):  lse = log Σ_v exp(z_v);  loss_i = lse − z_{t_i};
// then the row is overwritten with d(mean loss)/dz = (softmax(z) − onehot(t_i)) · inv_count.
// Rows whose target is ignore_index get loss 0 and a zero gradient. inv_count (1 / number of
// counted targets) is read from device memory, so the whole loss needs no host sync.
// The caller (gpu_kernels/ops/cross_entropy.py) turns the gradient chunk into the hidden-state
// gradient with one GEMM, so the full (N, V) logits never exist at once.

#include "common.cuh"

namespace {

// kVec: V % 8 == 0 and logits 16-byte aligned, so every row moves as 16-byte vectors.
template <typename T, bool kVec>
__global__ void ce_fwd_bwd_kernel(T* __restrict__ logits, int64_t V, const int64_t* __restrict__ targets,
                                  int64_t ignore_index, const float* __restrict__ inv_count,
                                  float* __restrict__ loss_out) {
  __shared__ float scratch[32];
  const int64_t row = blockIdx.x;
  T* z = logits + row * V;
  const int64_t t = targets[row];
  if (t == ignore_index) {
    for (int64_t i = threadIdx.x; i < V; i += blockDim.x) loraq_store(z, i, 0.f);
    if (threadIdx.x == 0) loss_out[row] = 0.f;
    return;
  }
  // online max / sum-of-exp per thread, then merged across the block
  float m = -INFINITY, s = 0.f;
  if (kVec) {
    for (int64_t i = threadIdx.x * 8LL; i < V; i += blockDim.x * 8LL) {
      float v[8];
      load8(z + i, v);
      float mx = v[0];
#pragma unroll
      for (int j = 1; j < 8; ++j) mx = fmaxf(mx, v[j]);
      const float m_new = fmaxf(m, mx);
      float add = 0.f;
#pragma unroll
      for (int j = 0; j < 8; ++j) add += __expf(v[j] - m_new);
      s = (m == -INFINITY ? 0.f : s * __expf(m - m_new)) + add;
      m = m_new;
    }
  } else {
    for (int64_t i = threadIdx.x; i < V; i += blockDim.x) {
      const float v = loraq_load(z, i);
      if (v > m) {
        s = (m == -INFINITY ? 0.f : s * __expf(m - v)) + 1.f;
        m = v;
      } else {
        s += __expf(v - m);
      }
    }
  }
  const float row_max = loraq_block_max(m, scratch);
  s = (m == -INFINITY) ? 0.f : s * __expf(m - row_max);
  const float sum = loraq_block_sum(s, scratch);
  const float lse = row_max + __logf(sum);
  const float zt = (t >= 0 && t < V) ? loraq_load(z, t) : NAN;  // out-of-range target: NaN loss
  __syncthreads();  // every thread has read z[t] before it is overwritten
  const float g = *inv_count;
  if (kVec) {
    for (int64_t i = threadIdx.x * 8LL; i < V; i += blockDim.x * 8LL) {
      float v[8];
      load8(z + i, v);
#pragma unroll
      for (int j = 0; j < 8; ++j) v[j] = (__expf(v[j] - lse) - (i + j == t ? 1.f : 0.f)) * g;
      store8(z + i, v);
    }
  } else {
    for (int64_t i = threadIdx.x; i < V; i += blockDim.x) {
      const float p = __expf(loraq_load(z, i) - lse);
      loraq_store(z, i, (p - (i == t ? 1.f : 0.f)) * g);
    }
  }
  if (threadIdx.x == 0) loss_out[row] = lse - zt;
}

}  // namespace

extern "C" {

int loraq_cross_entropy_fwd_bwd(void* logits, int dtype, int64_t n, int64_t V,
                                const int64_t* targets, int64_t ignore_index,
                                const float* inv_count, float* loss_out, cudaStream_t stream) {
  if (n == 0) return 0;
  if (n > 2147483647LL) return static_cast<int>(cudaErrorInvalidValue);
  const int threads = 1024;
  const bool vec = V % 8 == 0 && reinterpret_cast<uintptr_t>(logits) % 16 == 0;
  const unsigned grid = static_cast<unsigned>(n);
  if (dtype == LORAQ_BF16) {
    auto* z = static_cast<__nv_bfloat16*>(logits);
    if (vec) ce_fwd_bwd_kernel<__nv_bfloat16, true><<<grid, threads, 0, stream>>>(z, V, targets, ignore_index, inv_count, loss_out);
    else ce_fwd_bwd_kernel<__nv_bfloat16, false><<<grid, threads, 0, stream>>>(z, V, targets, ignore_index, inv_count, loss_out);
  } else if (dtype == LORAQ_F32) {
    auto* z = static_cast<float*>(logits);
    if (vec) ce_fwd_bwd_kernel<float, true><<<grid, threads, 0, stream>>>(z, V, targets, ignore_index, inv_count, loss_out);
    else ce_fwd_bwd_kernel<float, false><<<grid, threads, 0, stream>>>(z, V, targets, ignore_index, inv_count, loss_out);
  } else {
    return static_cast<int>(cudaErrorInvalidValue);
  }
  LORAQ_RETURN_LAST_ERROR;
}

}  // extern "C"
