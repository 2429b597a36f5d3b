// Checkpoint weights as loaded for the kernels (CheckpointWeights on the CPU backend).
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>

#include "backend/backend.h"
#include "io/checkpoint.h"
#include "model/weights.h"

namespace recur {
namespace {

namespace fs = std::filesystem;

// safetensors packs tensors without padding: "w" (F32) follows 3 BF16 values, so it starts 6
// bytes into the data, which the header's length puts at a multiple of 8 in the file. Loaded,
// it is a copy aligned for its type that holds its values (read in place, every access to it
// would be misaligned).
TEST(CheckpointWeights, ATensorOffItsAlignmentIsCopiedAligned) {
  const fs::path dir =
      fs::temp_directory_path() / ("recur-w-" + std::to_string(std::random_device{}()));
  fs::create_directories(dir);
  std::ofstream(dir / "config.json") << R"({"model_type":"qwen3_next"})";
  std::string header = R"({"pad":{"dtype":"BF16","shape":[3],"data_offsets":[0,6]},)"
                       R"("w":{"dtype":"F32","shape":[4],"data_offsets":[6,22]}})";
  header.append((8 - (8 + header.size()) % 8) % 8, ' ');
  std::string file(8, '\0');
  for (int i = 0; i < 8; ++i) file[size_t(i)] = char((header.size() >> (8 * i)) & 0xff);
  file += header;
  file += std::string(6, '\0');
  const float want[4] = {1.5f, -2.0f, 3.25f, 1e-30f};
  file.append(reinterpret_cast<const char*>(want), sizeof(want));
  std::ofstream(dir / "model.safetensors", std::ios::binary) << file;

  auto ck = Checkpoint::open(dir.string());
  ASSERT_TRUE(ck.ok()) << ck.error().to_string();
  auto mapped = ck->get("w", {4});
  ASSERT_TRUE(mapped.ok());
  ASSERT_NE(reinterpret_cast<uintptr_t>(mapped->data) % 4, 0u) << "the file must put w off 4 bytes";
  auto ops = create_backend("cpu", 1);
  ASSERT_TRUE(ops.ok());
  CheckpointWeights weights(*ck, **ops);
  auto w = weights.load("w", {4}, WeightUse::kVector);
  ASSERT_TRUE(w.ok()) << w.error().to_string();
  EXPECT_EQ(reinterpret_cast<uintptr_t>(w->data) % alignof(float), 0u);
  EXPECT_EQ(std::memcmp(w->data, want, sizeof(want)), 0);
  fs::remove_all(dir);
}

}  // namespace
}  // namespace recur
