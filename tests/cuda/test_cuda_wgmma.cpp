// The warpgroup products (backend/cuda/wgmma.cuh) read operands laid out as the prompt
// attention kernel lays them out: A K-major in shared memory or as registers, B MN-major
// (transposed), results in the mma.sync fragment order, for f16 and bf16 operands; and as the
// MoE experts' tiles lay them out (B K-major). Should the descriptor's two strides be read the
// other way round for the MN-major operand, the first test's second product says so.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "cuda/cuda_test_util.h"
#include "cuda/wgmma_layout_kernels.h"

namespace recur {
namespace {

using namespace testing;

// The value of 16-bit operand bits: f16, or bf16 with bf16.
double operand_value(uint16_t bits, bool bf16) {
  if (bf16) {
    const uint32_t u = uint32_t(bits) << 16;
    float f;
    std::memcpy(&f, &u, sizeof f);
    return f;
  }
  return double(__half2float(__ushort_as_half(bits)));
}

// Largest |d − a·b| over the product.
double product_error(const std::vector<uint16_t>& a, const std::vector<uint16_t>& b, int n,
                     bool bf16, const std::vector<float>& d) {
  double err = 0;
  for (int r = 0; r < 64; ++r) {
    for (int j = 0; j < n; ++j) {
      double s = 0;
      for (int k = 0; k < 16; ++k) {
        s += operand_value(a[r * 16 + k], bf16) * operand_value(b[k * n + j], bf16);
      }
      err = std::max(err, std::fabs(s - double(d[r * n + j])));
    }
  }
  return err;
}

TEST_F(CudaTest, WarpgroupProductsReadTheAttentionKernelsLayouts) {
  if (!device_is_sm90a()) GTEST_SKIP() << "no device running sm_90a code (wgmma)";
  std::mt19937 gen(7);
  std::uniform_real_distribution<float> u(-2.0f, 2.0f);
  auto operands = [&](size_t count, bool bf16) {
    std::vector<uint16_t> v(count);
    for (uint16_t& h : v) {
      h = bf16 ? __bfloat16_as_ushort(__float2bfloat16_rn(u(gen)))
               : __half_as_ushort(__float2half_rn(u(gen)));
    }
    return v;
  };
  for (const bool bf16 : {false, true}) {
    for (const int n : {32, 64, 128, 256}) {
      const bool registers_a = n != 32;  // the scores' product reads A from shared memory
      const std::vector<uint16_t> a = operands(64 * 16, bf16), b = operands(size_t(16) * n, bf16);
      std::vector<float> d(size_t(64) * n);
      ASSERT_TRUE(
          wgmma_layout_product(a.data(), b.data(), n, registers_a, bf16, 128, 256, d.data()));
      const double err = product_error(a, b, n, bf16, d);
      // Products of 16-bit values summed in f32: far below 1e-4 when every operand is where the
      // descriptors say.
      EXPECT_LE(err, 1e-4) << (bf16 ? "bf16" : "f16")
                           << (registers_a ? ", A in registers" : ", A in shared memory") << ", n "
                           << n;
      if (err > 1e-4) {
        ASSERT_TRUE(
            wgmma_layout_product(a.data(), b.data(), n, registers_a, bf16, 256, 128, d.data()));
        ADD_FAILURE() << "with the MN-major strides swapped the error is "
                      << product_error(a, b, n, bf16, d);
      }
    }
  }
}

// The MoE experts' kernel's product: the weights' fragments in registers, a tile's activations
// K-major (a token's k contiguous), 32 k in two products.
TEST_F(CudaTest, WarpgroupProductsReadTheExpertsKernelsLayout) {
  if (!device_is_sm90a()) GTEST_SKIP() << "no device running sm_90a code (wgmma)";
  std::mt19937 gen(11);
  std::uniform_real_distribution<float> u(-2.0f, 2.0f);
  std::vector<uint16_t> a(64 * 32), b(32 * 64);
  for (uint16_t& h : a) h = __half_as_ushort(__float2half_rn(u(gen)));
  for (uint16_t& h : b) h = __half_as_ushort(__float2half_rn(u(gen)));
  std::vector<float> d(64 * 64);
  ASSERT_TRUE(wgmma_kmajor_product(a.data(), b.data(), d.data()));
  double err = 0;
  for (int r = 0; r < 64; ++r) {
    for (int n = 0; n < 64; ++n) {
      double s = 0;
      for (int k = 0; k < 32; ++k) {
        s += operand_value(a[r * 32 + k], false) * operand_value(b[k * 64 + n], false);
      }
      err = std::max(err, std::fabs(s - double(d[r * 64 + n])));
    }
  }
  EXPECT_LE(err, 1e-4);
}

}  // namespace
}  // namespace recur
