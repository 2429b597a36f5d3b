// Integer-quantized weights on the CPU read their inputs quantized per token into an arena the
// model sizes at load (Ops::reserve): a forward of the most tokens a batch may carry, through
// every dense and expert matmul, allocates nothing.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "backend/cpu/cpu_ops.h"
#include "model/registry.h"

namespace {

const std::string kRoot = RECUR_SOURCE_DIR;
// Enough tokens that the experts' inputs (every routed pair) outweigh the widest dense input.
constexpr int kMaxTokens = 512;

void expect_full_batch_allocates_nothing(const std::string& model, recur::Quantize quantize) {
  recur::CpuOps ops(2);
  recur::LoadOptions opt;
  opt.max_batch_tokens = kMaxTokens;
  opt.state = {2, 40, 16};
  opt.quantize = quantize;
  auto loaded = recur::load_model(kRoot + "/models/" + model, ops, opt);
  ASSERT_TRUE(loaded.ok()) << loaded.error().message;
  recur::Model& m = **loaded;
  const size_t arena = ops.activation_arena_bytes();
  EXPECT_GT(arena, 0u) << model;  // sized at load, before any forward

  recur::Batch batch;
  std::vector<int32_t> prompt(kMaxTokens - 1), blocks(32);
  for (size_t i = 0; i < blocks.size(); ++i) blocks[i] = int32_t(i);
  for (size_t i = 0; i < prompt.size(); ++i) prompt[i] = int32_t(7 + 13 * i) % 200;
  batch.add_sequence(0, 0, prompt, blocks, recur::Batch::Logits::kAll);
  const std::vector<int32_t> one = {5};
  batch.add_sequence(1, 0, one, std::vector<int32_t>{32}, recur::Batch::Logits::kLast);
  ASSERT_EQ(batch.n_tokens(), kMaxTokens);
  std::vector<float> logits(size_t(batch.logit_rows.size()) * m.info().vocab_size);
  const recur::Tensor out =
      recur::Tensor::contiguous(logits.data(), recur::DType::F32,
                                {int64_t(batch.logit_rows.size()), int64_t(m.info().vocab_size)});
  const recur::AllocStats before = ops.allocator().stats();
  ASSERT_TRUE(m.forward(batch, out).ok());
  const recur::AllocStats after = ops.allocator().stats();
  EXPECT_EQ(after.allocs_total, before.allocs_total) << model;
  EXPECT_EQ(ops.activation_arena_bytes(), arena) << model;
}

TEST(QuantizedArena, DenseModelsFullBatchAllocatesNothing) {
  expect_full_batch_allocates_nothing("qwen3_5-tiny", recur::Quantize::kInt8);
  expect_full_batch_allocates_nothing("qwen3next-tiny", recur::Quantize::kQ4);
}

TEST(QuantizedArena, ExpertsOfEveryTokenAllocateNothing) {
  expect_full_batch_allocates_nothing("qwen3_5-moe-tiny", recur::Quantize::kInt8);
  expect_full_batch_allocates_nothing("kimi-linear-tiny", recur::Quantize::kQ4);
}

}  // namespace
