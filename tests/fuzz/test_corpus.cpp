// Every fuzz target over its committed corpus (tests/fuzz/corpus/<target>/): the seeds that
// start fuzzing and every input that once found a bug, so each bug stays fixed in every build.
#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "fuzz_targets.h"

namespace recur::fuzz {
namespace {

namespace fs = std::filesystem;

class Corpus : public testing::TestWithParam<Target> {};

TEST_P(Corpus, EveryInputPassesItsChecks) {
  const fs::path dir = fs::path(RECUR_SOURCE_DIR) / "tests/fuzz/corpus" / GetParam().name;
  ASSERT_TRUE(fs::is_directory(dir)) << dir;
  int inputs = 0;
  for (const auto& entry : fs::directory_iterator(dir)) {
    std::ifstream f(entry.path(), std::ios::binary);
    const std::vector<uint8_t> bytes{std::istreambuf_iterator<char>(f), {}};
    // A failed check aborts: the last input named is the one that failed.
    std::fprintf(stderr, "%s\n", entry.path().c_str());
    GetParam().run(bytes.data(), bytes.size());
    ++inputs;
  }
  EXPECT_GT(inputs, 0) << "no inputs in " << dir;
}

INSTANTIATE_TEST_SUITE_P(Fuzz, Corpus, testing::ValuesIn(kTargets),
                         [](const auto& info) { return std::string(info.param.name); });

}  // namespace
}  // namespace recur::fuzz
