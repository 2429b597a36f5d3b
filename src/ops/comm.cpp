#include "ops/comm.h"

#include <algorithm>
#include <cstring>

namespace recur {

class InProcessGroup::Rank final : public Communicator {
 public:
  Rank(InProcessGroup& group, int rank) : group_(group), rank_(rank) {}
  int rank() const override { return rank_; }
  int world() const override { return group_.world(); }

  // Rank r sums its share of the elements over every rank's x, in rank order (so the result
  // does not depend on who computes it), and writes the sum into every rank's x.
  void all_reduce_sum(Tensor x) override {
    RECUR_CHECK(x.dtype == DType::F32 && x.ndim >= 1);
    const int world = group_.world();
    const int64_t rows = x.ndim == 1 ? 1 : x.rows(), cols = x.ndim == 1 ? x.numel() : x.row_size();
    group_.published_[size_t(rank_)] = {x, {}};
    group_.barrier_.arrive_and_wait();  // every rank's x is final and published
    for (int r = 0; r < world; ++r) {
      const Tensor& o = group_.published_[size_t(r)].a;
      RECUR_CHECK(o.numel() == x.numel() && (o.ndim == 1 ? 1 : o.rows()) == rows);
    }
    // Whole rows per rank when there are enough; otherwise column ranges of every row.
    const int64_t total = rows * cols;
    const int64_t begin = total * rank_ / world, end = total * (rank_ + 1) / world;
    for (int64_t i = begin; i < end;) {
      const int64_t r = i / cols, c0 = i % cols, c1 = std::min(cols, c0 + (end - i));
      float* dst[64];
      RECUR_CHECK(world <= 64);
      for (int k = 0; k < world; ++k) {
        const Tensor& o = group_.published_[size_t(k)].a;
        dst[k] = o.ptr<float>() + (o.ndim == 1 ? 0 : r * o.row_stride());
      }
      for (int64_t c = c0; c < c1; ++c) {
        float s = dst[0][c];
        for (int k = 1; k < world; ++k) s += dst[k][c];
        for (int k = 0; k < world; ++k) dst[k][c] = s;
      }
      i += c1 - c0;
    }
    group_.barrier_.arrive_and_wait();  // every share written before anyone reads or writes x
  }

  // Each rank copies every rank's part into its own out.
  void all_gather_cols(const Tensor& part, Tensor out) override {
    RECUR_CHECK(part.dtype == DType::F32 && out.dtype == DType::F32 && part.ndim == 2 &&
                out.ndim == 2);
    const int world = group_.world();
    const int64_t rows = part.rows(), c = part.shape[1];
    RECUR_CHECK(out.rows() == rows && out.shape[1] == c * world);
    group_.published_[size_t(rank_)] = {part, out};
    group_.barrier_.arrive_and_wait();  // every part is final and published
    for (int k = 0; k < world; ++k) {
      const Tensor& p = group_.published_[size_t(k)].a;
      RECUR_CHECK(p.rows() == rows && p.shape[1] == c);
      for (int64_t r = 0; r < rows; ++r) {
        std::memcpy(out.row<float>(r) + k * c, p.row<float>(r), size_t(c) * sizeof(float));
      }
    }
    group_.barrier_.arrive_and_wait();  // every part read before its rank may write it again
  }

 private:
  InProcessGroup& group_;
  int rank_;
};

InProcessGroup::~InProcessGroup() = default;

Communicator& InProcessGroup::rank(int r) {
  return *ranks_[size_t(r)];
}

InProcessGroup::InProcessGroup(int world)
    : published_(size_t(std::max(world, 1))), barrier_(std::max(world, 1)) {
  RECUR_CHECK(world >= 1 && world <= 64);
  for (int r = 0; r < world; ++r) ranks_.push_back(std::make_unique<Rank>(*this, r));
}

}  // namespace recur
