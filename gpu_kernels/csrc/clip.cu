// Sync-free global-norm gradient clipping over many fp32 gradient tensors, in three launches:
//
//   1. sqnorm: every block sums the squares of one chunk of one tensor into partials[block]
//   2. finalize: one block reduces the partials, writes the norm and the clip scale
//      min(1, max_norm / (norm + 1e-6)) to device memory, and raises a sticky non-finite flag
//   3. scale: every block multiplies its chunk by the scale read from device memory
//
// No value comes back to the host, so the three launches can be captured in a CUDA graph. The
// tensor list (pointers, sizes, first block of each tensor) travels by value as a kernel
// parameter (up to kMaxTensors per launch; the host splits longer lists), so no host-to-device
// copy is needed either.

#include "common.cuh"

namespace {

constexpr int kMaxTensors = 512;  // 512 · 20 bytes + a few: well under the 32 KB parameter limit
constexpr int kChunk = 16384;     // elements per block
constexpr int kThreads = 512;

struct TensorList {
  float* ptr[kMaxTensors];
  int64_t numel[kMaxTensors];
  int32_t first_block[kMaxTensors + 1];  // blocks of tensor t: [first_block[t], first_block[t+1])
  int32_t n_tensors;
};

// The tensor that block b works on: the last t with first_block[t] <= b (binary search).
__device__ __forceinline__ int tensor_of_block(const TensorList& list, int b) {
  int lo = 0, hi = list.n_tensors - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (list.first_block[mid] <= b) lo = mid; else hi = mid - 1;
  }
  return lo;
}

__global__ void sqnorm_kernel(const __grid_constant__ TensorList list, float* __restrict__ partials) {
  __shared__ float scratch[32];
  const int t = tensor_of_block(list, blockIdx.x);
  const int64_t start = static_cast<int64_t>(blockIdx.x - list.first_block[t]) * kChunk;
  const int64_t end = min(start + kChunk, list.numel[t]);
  const float* p = list.ptr[t];
  float acc = 0.f;
  for (int64_t i = start + threadIdx.x; i < end; i += blockDim.x) acc += p[i] * p[i];
  acc = loraq_block_sum(acc, scratch);
  if (threadIdx.x == 0) partials[blockIdx.x] = acc;
}

// state[0]: first step (1-based) whose gradients were non-finite, 0 while all were finite;
// state[1]: number of finalize calls so far (the step counter).
__global__ void finalize_kernel(const float* __restrict__ partials, int n, float max_norm,
                                float* __restrict__ norm_out, float* __restrict__ scale_out,
                                int64_t* __restrict__ state) {
  __shared__ float scratch[32];
  float acc = 0.f;
  for (int i = threadIdx.x; i < n; i += blockDim.x) acc += partials[i];
  acc = loraq_block_sum(acc, scratch);
  if (threadIdx.x == 0) {
    const float norm = sqrtf(acc);
    *norm_out = norm;
    int64_t step = 0;
    if (state != nullptr) step = ++state[1];
    if (isfinite(norm)) {
      *scale_out = fminf(1.f, max_norm / (norm + 1e-6f));
    } else {
      *scale_out = 1.f;  // leave the grads as they are: the step is reported, not repaired
      if (state != nullptr && state[0] == 0) state[0] = step;
    }
  }
}

__global__ void scale_kernel(const __grid_constant__ TensorList list, const float* __restrict__ scale) {
  const int t = tensor_of_block(list, blockIdx.x);
  const int64_t start = static_cast<int64_t>(blockIdx.x - list.first_block[t]) * kChunk;
  const int64_t end = min(start + kChunk, list.numel[t]);
  const float s = *scale;
  if (s == 1.f) return;
  float* p = list.ptr[t];
  for (int64_t i = start + threadIdx.x; i < end; i += blockDim.x) p[i] *= s;
}

// Fill `list` with tensors [begin, end) of the arrays; returns the number of blocks.
int fill_list(TensorList* list, float* const* ptrs, const int64_t* numels, int begin, int end) {
  int blocks = 0;
  list->n_tensors = end - begin;
  for (int i = begin; i < end; ++i) {
    list->ptr[i - begin] = ptrs[i];
    list->numel[i - begin] = numels[i];
    list->first_block[i - begin] = blocks;
    blocks += static_cast<int>((numels[i] + kChunk - 1) / kChunk);
  }
  list->first_block[end - begin] = blocks;
  return blocks;
}

}  // namespace

extern "C" {

// Number of partial sums loraq_clip_grad_norm needs for these sizes (the caller allocates them).
int64_t loraq_clip_partials(const int64_t* numels, int n_tensors) {
  int64_t blocks = 0;
  for (int i = 0; i < n_tensors; ++i) blocks += (numels[i] + kChunk - 1) / kChunk;
  return blocks;
}

// Clip fp32 tensors in place to global L2 norm max_norm. Writes the norm to norm_out[0] and the
// scale to scale_out[0]; state (int64[2], or null) as in finalize_kernel. Every numel must be > 0.
int loraq_clip_grad_norm(float* const* ptrs, const int64_t* numels, int n_tensors, float max_norm,
                         float* partials, float* norm_out, float* scale_out, int64_t* state,
                         cudaStream_t stream) {
  if (n_tensors <= 0) return static_cast<int>(cudaErrorInvalidValue);
  TensorList list;
  int64_t offset = 0;
  for (int begin = 0; begin < n_tensors; begin += kMaxTensors) {
    const int end = min(begin + kMaxTensors, n_tensors);
    const int blocks = fill_list(&list, ptrs, numels, begin, end);
    sqnorm_kernel<<<blocks, kThreads, 0, stream>>>(list, partials + offset);
    offset += blocks;
  }
  finalize_kernel<<<1, 1024, 0, stream>>>(partials, static_cast<int>(offset), max_norm, norm_out,
                                          scale_out, state);
  for (int begin = 0; begin < n_tensors; begin += kMaxTensors) {
    const int end = min(begin + kMaxTensors, n_tensors);
    const int blocks = fill_list(&list, ptrs, numels, begin, end);
    scale_kernel<<<blocks, kThreads, 0, stream>>>(list, scale_out);
  }
  LORAQ_RETURN_LAST_ERROR;
}

}  // extern "C"
