// Vectorised transcendental functions over arrays (AVX-512 where available). Accurate to a
// few float ulps, which is far inside every tolerance the kernels are held to.
#pragma once

#include <cstdint>

namespace recur::cpu {

void exp_inplace(float* x, int64_t n);              // x = exp(x)
void silu_mul(const float* g, const float* u, float* out, int64_t n);  // out = silu(g)·u
void sigmoid_mul(float* x, const float* g, int64_t n);                // x ·= σ(g)

}  // namespace recur::cpu
