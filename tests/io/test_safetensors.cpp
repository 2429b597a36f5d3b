// The safetensors parser and the model-directory loader on broken input: every failure is a
// clear error naming the file and tensor, never a crash or a read past the mapping.
#include <gtest/gtest.h>

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <random>
#include <tuple>

#include "io/checkpoint.h"
#include "io/mapped_file.h"
#include "io/safetensors.h"

namespace recur {
namespace {

namespace fs = std::filesystem;

std::string make_file(const std::string& header, size_t data_bytes, uint64_t declared_len = ~0ull) {
  std::string s(8, '\0');
  uint64_t n = declared_len == ~0ull ? header.size() : declared_len;
  for (int i = 0; i < 8; ++i) s[size_t(i)] = char((n >> (8 * i)) & 0xff);
  s += header;
  s += std::string(data_bytes, '\x01');
  return s;
}

Result<std::map<std::string, SafetensorsEntry>> parse(const std::string& bytes) {
  return SafetensorsFile::parse(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size(),
                                "test.safetensors");
}

class TempDir {
 public:
  TempDir() {
    path_ = fs::temp_directory_path() / ("recur-io-" + std::to_string(std::random_device{}()));
    fs::create_directories(path_);
  }
  ~TempDir() { fs::remove_all(path_); }
  std::string write(const std::string& name, const std::string& bytes) const {
    std::ofstream(path_ / name, std::ios::binary) << bytes;
    return (path_ / name).string();
  }
  std::string str() const { return path_.string(); }

 private:
  fs::path path_;
};

const char* kGood =
    R"({"__metadata__":{"format":"pt"},"a":{"dtype":"BF16","shape":[2,3],"data_offsets":[0,12]}})";

TEST(Safetensors, ParsesAValidHeader) {
  auto r = parse(make_file(kGood, 12));
  ASSERT_TRUE(r.ok()) << r.error().to_string();
  ASSERT_EQ(r->size(), 1u);
  EXPECT_EQ(r->at("a").dtype, DType::BF16);
  EXPECT_EQ(r->at("a").bytes, 12u);
}

TEST(Safetensors, RejectsTruncatedAndOversizedHeaders) {
  auto tiny = parse("abc");
  ASSERT_FALSE(tiny.ok());
  EXPECT_NE(tiny.error().message.find("truncated"), std::string::npos);

  auto past_end = parse(make_file(kGood, 12, 1000));
  ASSERT_FALSE(past_end.ok());
  EXPECT_NE(past_end.error().message.find("past the end"), std::string::npos);

  auto huge = parse(make_file(kGood, 12, uint64_t(1) << 40));
  ASSERT_FALSE(huge.ok());
  EXPECT_NE(huge.error().message.find("exceeds"), std::string::npos);

  auto data_cut = parse(make_file(kGood, 11));  // one data byte missing
  ASSERT_FALSE(data_cut.ok());
  EXPECT_NE(data_cut.error().message.find("'a'"), std::string::npos);
}

TEST(Safetensors, RejectsCorruptEntries) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"not json {", "(its header): invalid JSON at byte 2"},
      {R"([1,2])", "not a JSON object"},
      {R"({"a":{"dtype":"Q4","shape":[2],"data_offsets":[0,2]}})", "unknown dtype 'Q4'"},
      {R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,4]}})", "needs 8"},
      {R"({"a":{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}})", "bad shape"},
      {R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[8,4]}})", "end before they begin"},
      {R"({"a":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,4]}})",
       "overflows"},
      {R"({"a":{"shape":[1],"data_offsets":[0,4]}})", "needs dtype"},
      {R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0]}})", "needs dtype"},
  };
  for (auto& [header, expect] : cases) {
    auto r = parse(make_file(header, 12));
    ASSERT_FALSE(r.ok()) << header;
    EXPECT_NE(r.error().message.find(expect), std::string::npos)
        << header << " -> " << r.error().message;
  }
}

// The tensors must tile the data exactly, as the format requires: no shared byte, no byte that
// belongs to no tensor, nothing past the end.
TEST(Safetensors, RejectsOverlapsGapsAndBytesOutsideEveryTensor) {
  const std::vector<std::tuple<std::string, size_t, std::string>> cases = {
      {R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
       R"("b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
       12, "tensors 'a' and 'b' overlap: 'b' starts at data byte 4, before 'a' ends at 8"},
      {R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
       R"("b":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})",
       8, "tensors 'a' and 'b' overlap"},
      {R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
       R"("b":{"dtype":"F32","shape":[1],"data_offsets":[8,12]}})",
       12, "data bytes [4, 8) belong to no tensor (a gap before 'b')"},
      {R"({"b":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", 8,
       "data bytes [0, 4) belong to no tensor (a gap before 'b')"},
      {kGood, 16, "data bytes [12, 16) after the last tensor belong to no tensor"},
      {R"({"a":{"dtype":"BF16","shape":[2,3],"data_offsets":[0,16]}})", 12,
       "data_offsets [0, 16] outside the 12 data bytes"},
  };
  for (auto& [header, data_bytes, expect] : cases) {
    auto r = parse(make_file(header, data_bytes));
    ASSERT_FALSE(r.ok()) << header;
    EXPECT_NE(r.error().message.find(expect), std::string::npos)
        << header << " -> " << r.error().message;
    EXPECT_EQ(r.error().code, ErrorCode::kCorrupt);
  }
  // Empty tensors take no bytes, anywhere in the order.
  auto empty = parse(make_file(R"({"e":{"dtype":"F32","shape":[0],"data_offsets":[4,4]},)"
                               R"("a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
                               R"("b":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})",
                               8));
  EXPECT_TRUE(empty.ok()) << empty.error().to_string();
}

// A shape whose byte count does not fit in 64 bits must not wrap around to the stored size.
TEST(Safetensors, RejectsShapesWhoseBytesOverflow) {
  // 2^62 doubles are 2^65 bytes, which wraps to 0; 2^61 + 1 of them wrap to 8.
  const std::vector<std::pair<std::string, size_t>> cases = {
      {R"({"a":{"dtype":"F64","shape":[4611686018427387904],"data_offsets":[0,0]}})", 0},
      {R"({"a":{"dtype":"F64","shape":[2305843009213693953],"data_offsets":[0,8]}})", 8},
      {R"({"a":{"dtype":"I32","shape":[2147483648,2147483648],"data_offsets":[0,0]}})", 0},
  };
  for (auto& [header, data_bytes] : cases) {
    auto r = parse(make_file(header, data_bytes));
    ASSERT_FALSE(r.ok()) << header;
    EXPECT_NE(r.error().message.find("needs more than the whole file"), std::string::npos)
        << header << " -> " << r.error().message;
  }
}

// Random bytes and random mutations of a valid file never crash the parser.
TEST(Safetensors, SurvivesFuzzedInput) {
  std::mt19937 rng(7);
  const std::string good = make_file(kGood, 12);
  for (int i = 0; i < 5000; ++i) {
    std::string s = good;
    const int flips = 1 + int(rng() % 8);
    for (int f = 0; f < flips; ++f) s[rng() % s.size()] = char(rng());
    if (rng() % 4 == 0) s.resize(rng() % s.size());
    auto r = parse(s);
    if (r.ok()) {
      for (auto& [name, e] : *r) ASSERT_LE(e.offset + e.bytes, s.size()) << name;
    }
  }
}

TEST(Checkpoint, NamesTheFileAndTensorOnShapeAndDtypeErrors) {
  TempDir dir;
  dir.write("config.json", R"({"model_type":"qwen3_next"})");
  dir.write("model.safetensors",
            make_file(R"({"w":{"dtype":"F32","shape":[2,3],"data_offsets":[0,24]},)"
                      R"("i":{"dtype":"I64","shape":[1],"data_offsets":[24,32]}})",
                      32));
  auto ck = Checkpoint::open(dir.str());
  ASSERT_TRUE(ck.ok()) << ck.error().to_string();
  EXPECT_TRUE(ck->get("w", {2, 3}).ok());
  auto bad_shape = ck->get("w", {3, 2});
  ASSERT_FALSE(bad_shape.ok());
  EXPECT_NE(bad_shape.error().message.find(
                "model.safetensors: tensor 'w' has shape [2, 3], expected [3, 2]"),
            std::string::npos)
      << bad_shape.error().message;
  auto bad_dtype = ck->get("i", {1});
  ASSERT_FALSE(bad_dtype.ok());
  EXPECT_NE(bad_dtype.error().message.find("'i' has dtype I64"), std::string::npos);
  auto missing = ck->get("nope", {1});
  ASSERT_FALSE(missing.ok());
  EXPECT_NE(missing.error().message.find("missing tensor 'nope'"), std::string::npos);
  auto unused = ck->unused({});
  ASSERT_EQ(unused.size(), 1u);
  EXPECT_EQ(unused[0], "i");
}

TEST(Checkpoint, LoadsShardsThroughTheIndex) {
  TempDir dir;
  dir.write("config.json", R"({"model_type":"qwen3_next"})");
  dir.write("model-00001-of-00002.safetensors",
            make_file(R"({"a":{"dtype":"F16","shape":[2],"data_offsets":[0,4]}})", 4));
  dir.write("model-00002-of-00002.safetensors",
            make_file(R"({"b":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})", 4));
  dir.write(
      "model.safetensors.index.json",
      R"({"weight_map":{"a":"model-00001-of-00002.safetensors","b":"model-00002-of-00002.safetensors"}})");
  auto ck = Checkpoint::open(dir.str());
  ASSERT_TRUE(ck.ok()) << ck.error().to_string();
  EXPECT_TRUE(ck->get("a", {2}).ok());
  EXPECT_TRUE(ck->get("b", {1}).ok());
  EXPECT_TRUE(ck->unused({}).empty());
}

TEST(Checkpoint, RejectsAnIndexThatMisplacesATensor) {
  TempDir dir;
  dir.write("config.json", R"({"model_type":"qwen3_next"})");
  dir.write("s1.safetensors",
            make_file(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})", 4));
  dir.write("s2.safetensors",
            make_file(R"({"b":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})", 4));
  dir.write("model.safetensors.index.json",
            R"({"weight_map":{"a":"s2.safetensors","b":"s2.safetensors","c":"s1.safetensors"}})");
  auto ck = Checkpoint::open(dir.str());
  ASSERT_FALSE(ck.ok());
  EXPECT_NE(ck.error().message.find("weight_map puts 'a' in s2.safetensors, but it is in "),
            std::string::npos)
      << ck.error().message;
  dir.write("model.safetensors.index.json",
            R"({"weight_map":{"a":"s1.safetensors","b":"s2.safetensors","c":"s1.safetensors"}})");
  ck = Checkpoint::open(dir.str());
  ASSERT_FALSE(ck.ok());
  EXPECT_NE(ck.error().message.find("weight_map puts 'c' in s1.safetensors, but no shard has it"),
            std::string::npos)
      << ck.error().message;
}

TEST(MappedFile, ReadTextFileRefusesDirectoriesAndOversizedFiles) {
  TempDir dir;
  const std::string path = dir.write("ten.txt", "0123456789");
  auto ok = read_text_file(path, 10);
  ASSERT_TRUE(ok.ok()) << ok.error().to_string();
  EXPECT_EQ(*ok, "0123456789");
  auto big = read_text_file(path, 9);
  ASSERT_FALSE(big.ok());
  EXPECT_NE(big.error().message.find("has 10 bytes; text files over 9 are refused"),
            std::string::npos)
      << big.error().message;
  auto directory = read_text_file(dir.str());
  ASSERT_FALSE(directory.ok());
  EXPECT_NE(directory.error().message.find("is not a regular file"), std::string::npos);
  auto missing = read_text_file(dir.str() + "/nope.json");
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.error().code, ErrorCode::kNotFound);
}

// A FIFO where a file should be is refused at once: opening it for reading would wait for a
// writer that never comes.
TEST(MappedFile, AFifoIsRefusedWithoutWaitingForAWriter) {
  TempDir dir;
  const std::string path = dir.str() + "/config.json";
  ASSERT_EQ(mkfifo(path.c_str(), 0600), 0);
  auto text = read_text_file(path);
  ASSERT_FALSE(text.ok());
  EXPECT_NE(text.error().message.find("is not a regular file"), std::string::npos)
      << text.error().message;
  auto mapped = MappedFile::open(path);
  ASSERT_FALSE(mapped.ok());
  auto checkpoint = Checkpoint::open(dir.str());
  ASSERT_FALSE(checkpoint.ok());
  EXPECT_NE(checkpoint.error().message.find("config.json is not a regular file"), std::string::npos)
      << checkpoint.error().message;
}

// A /proc file is a regular file whose size reads 0 though it holds text: like a file that grew
// after its size was checked, it is read no further than that size.
TEST(MappedFile, ReadTextFileReadsNoFurtherThanTheSizeItChecked) {
  const fs::path status = "/proc/self/status";
  std::error_code ec;
  if (!fs::is_regular_file(status, ec) || fs::file_size(status, ec) != 0) {
    GTEST_SKIP() << "no /proc/self/status of size 0 here";
  }
  auto text = read_text_file(status.string());
  ASSERT_TRUE(text.ok()) << text.error().to_string();
  EXPECT_EQ(*text, "");
}

// This process's resident bytes (/proc/self/statm), for the release test.
size_t resident_bytes() {
  std::ifstream statm("/proc/self/statm");
  size_t pages = 0, resident = 0;
  statm >> pages >> resident;
  return resident * size_t(sysconf(_SC_PAGESIZE));
}

// Released pages stop counting as resident and read back the same bytes; a range past the
// mapping or outside it is clipped or ignored.
TEST(MappedFile, ReleasedPagesLeaveResidentMemoryAndStayReadable) {
  TempDir dir;
  constexpr size_t kBytes = size_t(64) << 20;
  std::string bytes(kBytes, '\0');
  for (size_t i = 0; i < kBytes; i += 4096) bytes[i] = char(i / 4096 * 7 + 1);
  auto f = MappedFile::open(dir.write("big.bin", bytes));
  ASSERT_TRUE(f.ok()) << f.error().to_string();
  uint64_t sum = 0;
  for (size_t i = 0; i < kBytes; i += 4096) sum += uint8_t(f->data()[i]);  // every page in
  const size_t before = resident_bytes();
  f->release(f->data() + 100, kBytes * 2);  // clipped to the mapping; the first page stays
  f->release(bytes.data(), kBytes);         // not in the mapping: nothing
  const size_t after = resident_bytes();
  EXPECT_GE(before - std::min(before, after), kBytes / 2) << before << " -> " << after;
  uint64_t again = 0;
  for (size_t i = 0; i < kBytes; i += 4096) again += uint8_t(f->data()[i]);
  EXPECT_EQ(again, sum);
}

TEST(Checkpoint, ReportsMissingFilesAndBrokenJson) {
  TempDir dir;
  auto no_config = Checkpoint::open(dir.str());
  ASSERT_FALSE(no_config.ok());
  EXPECT_NE(no_config.error().message.find("config.json"), std::string::npos);
  dir.write("config.json", "{\"model_type\": ");
  auto bad_json = Checkpoint::open(dir.str());
  ASSERT_FALSE(bad_json.ok());
  EXPECT_NE(bad_json.error().message.find("invalid JSON"), std::string::npos);
  // A number past a double's range is nlohmann's out_of_range, not a parse error: the message
  // still names the file.
  dir.write("config.json", R"({"rope_theta": 1e999})");
  auto overflow = Checkpoint::open(dir.str());
  ASSERT_FALSE(overflow.ok());
  EXPECT_NE(overflow.error().message.find("config.json: invalid JSON"), std::string::npos)
      << overflow.error().message;
  EXPECT_NE(overflow.error().message.find("1e999"), std::string::npos) << overflow.error().message;
  dir.write("config.json", "{}");
  auto no_weights = Checkpoint::open(dir.str());
  ASSERT_FALSE(no_weights.ok());
  EXPECT_NE(no_weights.error().message.find("model.safetensors"), std::string::npos);
  dir.write("model.safetensors.index.json", R"({"weight_map":{"a":"../../etc/passwd"}})");
  auto escape = Checkpoint::open(dir.str());
  ASSERT_FALSE(escape.ok());
  EXPECT_NE(escape.error().message.find("leaves the directory"), std::string::npos);
  EXPECT_FALSE(Checkpoint::open(dir.str() + "/does-not-exist").ok());
}

}  // namespace
}  // namespace recur
