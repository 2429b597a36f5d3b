// Quantized weights on the CUDA backend: until it has fp8 kernels, a block-FP8 weight (and a
// --quantize int8/q4 weight) is refused with an error that says so, not a crash.
#include <vector>

#include "cuda/cuda_test_util.h"

namespace recur {
namespace {

using testing::CudaTest;
using testing::HostTensor;

class CudaQuant : public CudaTest {};

TEST_F(CudaQuant, BlockFp8AndQuantizedWeightsAreRefusedWithAClearError) {
  HostTensor w(DType::F8_E4M3, {192, 256}), s(DType::F32, {2, 2});
  std::vector<Buffer> owned;
  auto fp8 = ops().adopt_block_fp8_weight(w.t, s.t, 128, 128, &owned);
  ASSERT_FALSE(fp8.ok());
  EXPECT_NE(fp8.error().message.find("does not run block-FP8"), std::string::npos)
      << fp8.error().message;
  HostTensor b(DType::BF16, {64, 64});
  auto q = ops().quantize_matmul_weight(b.t, DType::Q4_32, &owned);
  ASSERT_FALSE(q.ok());
  EXPECT_NE(q.error().message.find("Q4_32"), std::string::npos) << q.error().message;
  EXPECT_TRUE(owned.empty());
}

}  // namespace
}  // namespace recur
