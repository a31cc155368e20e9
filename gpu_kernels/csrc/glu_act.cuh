// The gated MLP's activations, act(g) and act'(g): SiLU (SwiGLU) and tanh-approximated GELU
// (GeGLU, Gemma). Shared by csrc/norm_act.cu and csrc/lora_mlp.cu; fp32 in and out.
#pragma once

#include <cuda_runtime.h>

namespace glu {

__device__ __forceinline__ float sigmoidf(float v) { return 1.f / (1.f + __expf(-v)); }

// activation codes shared with gpu_kernels/ops/norm_act.py
constexpr int kSiLU = 0;
constexpr int kGeluTanh = 1;
constexpr float kGeluK = 0.7978845608028654f;  // sqrt(2 / pi)
constexpr float kGeluC = 0.044715f;

template <int kAct>
__device__ __forceinline__ float act_fwd(float g) {
  if constexpr (kAct == kSiLU) {
    return g * sigmoidf(g);
  } else {
    return 0.5f * g * (1.f + tanhf(kGeluK * (g + kGeluC * g * g * g)));
  }
}

// act(g) and act'(g) together
template <int kAct>
__device__ __forceinline__ void act_fwd_grad(float g, float& a, float& da) {
  if constexpr (kAct == kSiLU) {
    const float sg = sigmoidf(g);
    a = g * sg;
    da = sg * (1.f + g * (1.f - sg));
  } else {
    const float t = tanhf(kGeluK * (g + kGeluC * g * g * g));
    a = 0.5f * g * (1.f + t);
    da = 0.5f * (1.f + t) + 0.5f * g * (1.f - t * t) * kGeluK * (1.f + 3.f * kGeluC * g * g);
  }
}

}  // namespace glu
