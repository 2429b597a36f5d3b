// Reproducible token ids for engine tests.
#pragma once

#include <cstdint>
#include <random>
#include <vector>

namespace recur {

// len ids in [0, vocab), the same for the same seed.
inline std::vector<int32_t> random_tokens(int len, int vocab, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<int32_t> p(static_cast<size_t>(len));
  for (auto& t : p) t = int32_t(rng() % uint32_t(vocab));
  return p;
}

}  // namespace recur
