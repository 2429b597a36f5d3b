// The in-process communicator: ranks as threads, every collective's result against the sum or
// the concatenation computed here, over many calls in a row (a barrier that let a rank run
// ahead would mix one call's data into the next).
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <thread>
#include <vector>

#include "ops/comm.h"

namespace recur {
namespace {

// Runs fn(rank) on `world` threads at once.
template <typename Fn>
void on_ranks(int world, Fn fn) {
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) threads.emplace_back([&, r] { fn(r); });
  for (std::thread& t : threads) t.join();
}

class CommTest : public ::testing::TestWithParam<int> {};

// Values of rank r, call i, element e: distinct enough that a missing rank, a rank counted
// twice or another call's data changes the sum.
float value(int r, int call, int64_t e) {
  return float((r + 1) * 1000 + call * 7 + e % 97) + 0.25f * float(r);
}

TEST_P(CommTest, AllReduceSumsEveryRankOnce) {
  const int world = GetParam();
  InProcessGroup group(world);
  constexpr int kCalls = 200;
  constexpr int64_t kRows = 3, kCols = 37, kStride = 40;  // strided rows: padding untouched
  std::vector<std::vector<float>> data(static_cast<size_t>(world),
                                       std::vector<float>(kRows * kStride));
  std::vector<int> failures(size_t(world), 0);
  on_ranks(world, [&](int r) {
    Communicator& c = group.rank(r);
    EXPECT_EQ(c.rank(), r);
    EXPECT_EQ(c.world(), world);
    std::vector<float>& d = data[size_t(r)];
    Tensor x = Tensor::contiguous(d.data(), DType::F32, {kRows, kStride}).slice_cols(0, kCols);
    for (int call = 0; call < kCalls; ++call) {
      // Rows of 1..kRows: decode steps and prompt chunks alternate in a forward.
      const int64_t rows = 1 + call % kRows;
      for (int64_t i = 0; i < kRows * kStride; ++i) d[size_t(i)] = -1.0f;
      for (int64_t row = 0; row < rows; ++row) {
        for (int64_t col = 0; col < kCols; ++col) {
          d[size_t(row * kStride + col)] = value(r, call, row * kCols + col);
        }
      }
      c.all_reduce_sum(x.slice_rows(0, rows));
      for (int64_t row = 0; row < kRows; ++row) {
        for (int64_t col = 0; col < kStride; ++col) {
          float want = -1.0f;
          if (row < rows && col < kCols) {
            want = 0.0f;
            for (int k = 0; k < world; ++k) want += value(k, call, row * kCols + col);
          }
          if (d[size_t(row * kStride + col)] != want) ++failures[size_t(r)];
        }
      }
    }
  });
  for (int r = 0; r < world; ++r) EXPECT_EQ(failures[size_t(r)], 0) << "rank " << r;
}

TEST_P(CommTest, AllReduceIsBitwiseTheSameOnEveryRank) {
  const int world = GetParam();
  InProcessGroup group(world);
  constexpr int64_t kN = 1001;
  std::vector<std::vector<float>> data(static_cast<size_t>(world), std::vector<float>(kN));
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  for (auto& d : data) {
    for (float& v : d) v = u(rng) * 1e3f;  // rounding differs with the order of the sum
  }
  on_ranks(world, [&](int r) {
    group.rank(r).all_reduce_sum(Tensor::contiguous(data[size_t(r)].data(), DType::F32, {kN}));
  });
  for (int r = 1; r < world; ++r) {
    EXPECT_EQ(std::memcmp(data[0].data(), data[size_t(r)].data(), kN * sizeof(float)), 0);
  }
}

TEST_P(CommTest, AllGatherPlacesEachRanksColumns) {
  const int world = GetParam();
  InProcessGroup group(world);
  constexpr int kCalls = 100;
  constexpr int64_t kRows = 4, kCols = 5;
  std::vector<int> failures(size_t(world), 0);
  on_ranks(world, [&](int r) {
    Communicator& c = group.rank(r);
    std::vector<float> part(kRows * kCols), out(size_t(kRows * kCols * world + 3), -1.0f);
    for (int call = 0; call < kCalls; ++call) {
      const int64_t rows = 1 + call % kRows;
      for (int64_t i = 0; i < rows * kCols; ++i) part[size_t(i)] = value(r, call, i);
      std::fill(out.begin(), out.end(), -1.0f);
      Tensor p = Tensor::contiguous(part.data(), DType::F32, {rows, kCols});
      Tensor o = Tensor::contiguous(out.data(), DType::F32, {rows, kCols * world});
      c.all_gather_cols(p, o);
      for (int64_t row = 0; row < rows; ++row) {
        for (int k = 0; k < world; ++k) {
          for (int64_t col = 0; col < kCols; ++col) {
            if (out[size_t(row * kCols * world + k * kCols + col)] !=
                value(k, call, row * kCols + col)) {
              ++failures[size_t(r)];
            }
          }
        }
      }
      for (size_t i = size_t(rows * kCols * world); i < out.size(); ++i) {
        if (out[i] != -1.0f) ++failures[size_t(r)];  // nothing written past the rows
      }
    }
  });
  for (int r = 0; r < world; ++r) EXPECT_EQ(failures[size_t(r)], 0) << "rank " << r;
}

INSTANTIATE_TEST_SUITE_P(Ranks, CommTest, ::testing::Values(1, 2, 3, 4));

}  // namespace
}  // namespace recur
