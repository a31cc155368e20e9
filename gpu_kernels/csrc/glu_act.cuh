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

// tanh-GELU through the sigmoid: with t = tanh(z), (1 + t) / 2 = σ(2z) and 1 − t² = 4σ(2z)(1 − σ(2z)),
// so gelu(g) = g·σ(2z) and gelu'(g) = σ + 2g·σ(1 − σ)·k(1 + 3c·g²), z = k(g + c·g³): one fast
// exponential instead of tanhf's range reduction and polynomial, and no cancellation in 1 + t
// where t nears −1.
template <int kAct>
__device__ __forceinline__ float act_fwd(float g) {
  if constexpr (kAct == kSiLU) {
    return g * sigmoidf(g);
  } else {
    return g * sigmoidf(2.f * kGeluK * (g + kGeluC * g * g * g));
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
    const float s = sigmoidf(2.f * kGeluK * (g + kGeluC * g * g * g));  // (1 + t) / 2
    a = g * s;
    da = s + 2.f * g * s * (1.f - s) * kGeluK * (1.f + 3.f * kGeluC * g * g);
  }
}

}  // namespace glu
