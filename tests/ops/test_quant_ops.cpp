// Quantized matmul weights on the CPU (block-FP8, Q8_32, Q4_32): each instruction set's kernels
// against the plain scalar reference beside them (bit for bit), and all of them against the
// definition — the weights as stored, dequantized, times the activations — in double.
#include <cmath>
#include <random>
#include <vector>

#include "backend/cpu/cpu_ops.h"
#include "backend/cpu/kernels_quant.h"
#include "ops/op_test_util.h"

namespace recur {
namespace {

using cpu::QuantIsa;
using testing::fill_random;
using testing::HostTensor;

constexpr QuantIsa kIsas[] = {QuantIsa::kScalar, QuantIsa::kAvx2, QuantIsa::kAvx512};

class QuantOps : public ::testing::Test {
 protected:
  CpuOps ops{2};
  std::mt19937 rng{99};
};

// Random fp8 bytes (every finite code) and block scales; m, k awkward, blocks partial.
struct Fp8Weight {
  std::vector<uint8_t> bytes;  // [m, k]
  std::vector<float> scales;   // [ceil(m / br), ceil(k / bc)]
  int64_t m, k;
  int br, bc;
  float at(int64_t r, int64_t c) const {
    const int64_t kb = (k + bc - 1) / bc;
    return f8_e4m3_to_f32(bytes[size_t(r * k + c)]) * scales[size_t((r / br) * kb + c / bc)];
  }
};

Fp8Weight random_fp8(std::mt19937& rng, int64_t m, int64_t k, int br, int bc) {
  Fp8Weight w{{}, {}, m, k, br, bc};
  std::uniform_int_distribution<int> byte(0, 255);
  for (int64_t i = 0; i < m * k; ++i) {
    uint8_t b;
    do b = uint8_t(byte(rng));
    while ((b & 0x7f) == 0x7f);  // not the NaN codes
    w.bytes.push_back(b);
  }
  std::uniform_real_distribution<float> scale(1e-4f, 3e-3f);
  const int64_t n_scales = ((m + br - 1) / br) * ((k + bc - 1) / bc);
  for (int64_t i = 0; i < n_scales; ++i) w.scales.push_back(scale(rng));
  return w;
}

// out [n, m] in double from a function giving w[r][c].
template <typename W>
std::vector<double> reference(const HostTensor& x, int64_t m, int64_t k, W w) {
  const int64_t n = x.t.shape[0];
  std::vector<double> out(size_t(n * m));
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t r = 0; r < m; ++r) {
      double acc = 0;
      for (int64_t c = 0; c < k; ++c) acc += double(x.f()[t * k + c]) * double(w(r, c));
      out[size_t(t * m + r)] = acc;
    }
  }
  return out;
}

// The largest |a - b| relative to the largest |b|.
double rel_err(const float* a, const std::vector<double>& b) {
  double err = 0, big = 1e-30;
  for (size_t i = 0; i < b.size(); ++i) {
    err = std::max(err, std::fabs(double(a[i]) - b[i]));
    big = std::max(big, std::fabs(b[i]));
  }
  return err / big;
}

TEST(QuantFormats, Fp8E4m3ConversionsRoundTripEveryCode) {
  for (int b = 0; b < 256; ++b) {
    const float f = f8_e4m3_to_f32(uint8_t(b));
    if ((b & 0x7f) == 0x7f) {
      EXPECT_TRUE(std::isnan(f)) << b;
      continue;
    }
    EXPECT_EQ(f32_to_f8_e4m3(f) & (f == 0.0f ? 0x7f : 0xff), f == 0.0f ? 0 : b) << b;
  }
  EXPECT_EQ(f8_e4m3_to_f32(0x7e), 448.0f);
  EXPECT_EQ(f8_e4m3_to_f32(0x01), 1.0f / 512.0f);  // smallest subnormal
  EXPECT_EQ(f8_e4m3_to_f32(0xb8), -1.0f);
  EXPECT_EQ(f32_to_f8_e4m3(1000.0f), 0x7e);  // saturates
  EXPECT_EQ(f32_to_f8_e4m3(1.0625f), 0x38);  // a tie goes to the even mantissa (1.0)
}

// Block-FP8 weights: the CPU's layout dequantizes to exactly the stored fp8 × block scale, and
// every instruction set's matmul equals the scalar reference bit for bit and the definition
// within f32 rounding, with partial edge blocks in both directions and any token count.
TEST_F(QuantOps, BlockFp8MatmulMatchesDefinitionOnEveryIsa) {
  struct Case {
    int64_t m, k;
    int br, bc;
  } cases[] = {{192, 256, 128, 128}, {37, 200, 128, 128}, {70, 96, 64, 128}, {130, 33, 16, 16}};
  for (const Case& cs : cases) {
    const Fp8Weight w = random_fp8(rng, cs.m, cs.k, cs.br, cs.bc);
    const Tensor wt =
        Tensor::contiguous(const_cast<uint8_t*>(w.bytes.data()), DType::F8_E4M3, {cs.m, cs.k});
    const Tensor st = Tensor::contiguous(const_cast<float*>(w.scales.data()), DType::F32,
                                         {int64_t(w.scales.size())});
    std::vector<Buffer> owned;
    auto adopted = ops.adopt_block_fp8_weight(wt, st, cs.br, cs.bc, &owned);
    ASSERT_TRUE(adopted.ok()) << adopted.error().to_string();
    for (int64_t r = 0; r < cs.m; ++r) {
      for (int64_t c = 0; c < cs.k; ++c) {
        ASSERT_EQ(cpu::quant_weight_at(*adopted, r, c), w.at(r, c)) << r << "," << c;
      }
    }
    for (int64_t n : {1, 2, 3, 7}) {
      HostTensor x(DType::F32, {n, cs.k}), out(DType::F32, {n, cs.m});
      fill_random(x, rng);
      const std::vector<double> want =
          reference(x, cs.m, cs.k, [&](int64_t r, int64_t c) { return w.at(r, c); });
      ops.matmul(x.t, *adopted, out.t);
      EXPECT_LT(rel_err(out.f(), want), 1e-5) << cs.m << "x" << cs.k << " n=" << n;
      HostTensor scalar(DType::F32, {n, cs.m});
      cpu::quant_matmul_columns(QuantIsa::kScalar, *adopted, x.f(), cs.k, nullptr, n, scalar.f(),
                                cs.m, 0, cs.m, false);
      for (QuantIsa isa : kIsas) {
        if (!cpu::quant_isa_supported(isa)) continue;
        HostTensor got(DType::F32, {n, cs.m});
        cpu::quant_matmul_columns(isa, *adopted, x.f(), cs.k, nullptr, n, got.f(), cs.m, 0, cs.m,
                                  false);
        for (int64_t i = 0; i < n * cs.m; ++i) {
          ASSERT_EQ(got.f()[i], scalar.f()[i]) << cpu::quant_isa_name(isa) << " at " << i;
        }
      }
    }
  }
}

// Q8_32 / Q4_32: quantization error within the format's bound, and each instruction set's
// integer dot products (VNNI, AVX2) equal to the scalar reference bit for bit; the result is the
// dequantized weights times the quantized activations, exactly as defined.
TEST_F(QuantOps, IntegerFormatsMatchScalarReferenceOnEveryIsa) {
  for (DType dt : {DType::Q8_32, DType::Q4_32}) {
    for (auto [m, k] : {std::pair<int64_t, int64_t>{70, 96}, {16, 32}, {129, 256}}) {
      HostTensor w(DType::BF16, {m, k});
      fill_random(w, rng, 0.05f);
      std::vector<Buffer> owned;
      auto q = ops.quantize_matmul_weight(w.t, dt, &owned);
      ASSERT_TRUE(q.ok()) << q.error().to_string();
      // Per group of 32: |w - dequantized| <= half a step (Q8: amax/127), or for Q4 (step
      // amax/8, the extreme at -8) a whole step where a value of the other sign is clamped to 7.
      for (int64_t r = 0; r < m; ++r) {
        for (int64_t g = 0; g < k / 32; ++g) {
          float amax = 0;
          for (int c = 0; c < 32; ++c)
            amax = std::max(amax, std::fabs(bf16_to_f32(w.t.ptr<uint16_t>()[r * k + 32 * g + c])));
          const float step = dt == DType::Q8_32 ? amax / 127 : amax / 8;
          for (int c = 0; c < 32; ++c) {
            const float orig = bf16_to_f32(w.t.ptr<uint16_t>()[r * k + 32 * g + c]);
            const float bound = (dt == DType::Q8_32 ? 0.5f : 1.0f) * step * 1.01f;
            ASSERT_LE(std::fabs(cpu::quant_weight_at(*q, r, 32 * g + c) - orig), bound)
                << dtype_name(dt) << " " << r << "," << 32 * g + c;
          }
        }
      }
      for (int64_t n : {1, 3, 4, 9}) {
        HostTensor x(DType::F32, {n, k}), out(DType::F32, {n, m});
        fill_random(x, rng);
        std::vector<int64_t> memory((cpu::quantized_activation_bytes(n, k) + 63) / 8);
        // 64-byte aligned inside `memory`
        void* base =
            reinterpret_cast<void*>((reinterpret_cast<uintptr_t>(memory.data()) + 63) / 64 * 64);
        const cpu::QuantizedActivations xq = cpu::quantize_activations(x.f(), k, n, k, base);
        // The definition: dequantized weights × dequantized activations, in double.
        const std::vector<double> want = reference(
            x, m, k, [&](int64_t r, int64_t c) { return double(cpu::quant_weight_at(*q, r, c)); });
        HostTensor xd(DType::F32, {n, k});
        for (int64_t t = 0; t < n; ++t) {
          for (int64_t c = 0; c < k; ++c) {
            xd.f()[t * k + c] =
                float(xq.q[size_t(t * k + c)]) * xq.scale[size_t(t * (k / 32) + c / 32)];
          }
        }
        const std::vector<double> exact = reference(
            xd, m, k, [&](int64_t r, int64_t c) { return double(cpu::quant_weight_at(*q, r, c)); });
        ops.matmul(x.t, *q, out.t);
        EXPECT_LT(rel_err(out.f(), exact), 1e-5) << dtype_name(dt) << " n=" << n;
        // Activation quantization costs about 1% here, not more.
        EXPECT_LT(rel_err(out.f(), want), 3e-2) << dtype_name(dt) << " n=" << n;
        HostTensor scalar(DType::F32, {n, m});
        cpu::quant_matmul_columns(QuantIsa::kScalar, *q, nullptr, 0, &xq, n, scalar.f(), m, 0, m,
                                  false);
        for (QuantIsa isa : kIsas) {
          if (!cpu::quant_isa_supported(isa)) continue;
          HostTensor got(DType::F32, {n, m});
          for (int64_t i = 0; i < n * m; ++i) got.f()[i] = 1.0f;
          cpu::quant_matmul_columns(isa, *q, nullptr, 0, &xq, n, got.f(), m, 0, m, true);
          for (int64_t i = 0; i < n * m; ++i) {
            ASSERT_EQ(got.f()[i], 1.0f + scalar.f()[i]) << cpu::quant_isa_name(isa) << " " << i;
          }
        }
      }
    }
  }
}

// This machine runs the fast paths (the differential tests above would otherwise only compare
// the scalar reference with itself): AVX2 at least on any x86-64 CPU these tests run on.
TEST(QuantFormats, RunTimeDispatchPicksTheBestSupportedIsa) {
  const QuantIsa best = cpu::best_quant_isa();
  EXPECT_TRUE(cpu::quant_isa_supported(best));
  if (cpu::quant_isa_supported(QuantIsa::kAvx512)) {
    EXPECT_EQ(best, QuantIsa::kAvx512);
  }
#if defined(__x86_64__)
  EXPECT_NE(best, QuantIsa::kScalar);
#endif
}

}  // namespace
}  // namespace recur
