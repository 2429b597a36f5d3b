// Tokenizer encode throughput on one thread, with and without the piece cache; the
// description in main() is what --help prints.
#include <fmt/format.h>
#include <CLI/CLI.hpp>

#include <time.h>

#include <chrono>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "tokenizer/tokenizer.h"

using namespace recur;

namespace {

constexpr double kTargetMBps = 10.0;

struct Corpus {
  std::string name;
  std::vector<std::string> texts;
  size_t bytes = 0;
};

std::vector<Corpus> load_corpora() {
  std::vector<Corpus> corpora = {{"license-en", {}, 0}, {"code", {}, 0}, {"cjk-*", {}, 0}};
  std::ifstream in(std::string(RECUR_SOURCE_DIR) + "/tests/data/tokenizer-qwen3/encode.jsonl");
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty()) continue;
    auto j = nlohmann::json::parse(line);
    std::string kind = j["kind"].get<std::string>();
    for (Corpus& c : corpora) {
      bool match = c.name.ends_with("*") ? kind.starts_with(c.name.substr(0, c.name.size() - 1))
                                         : kind == c.name;
      if (match) {
        c.texts.push_back(j["text"].get<std::string>());
        c.bytes += c.texts.back().size();
      }
    }
  }
  return corpora;
}

struct Measure {
  size_t passes = 0;
  double seconds = 0;      // wall clock
  double cpu_seconds = 0;  // this thread's CPU time: what the figure would be on an idle core
  size_t tokens = 0;
};

double thread_cpu_seconds() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + static_cast<double>(ts.tv_nsec) * 1e-9;
}

Measure measure(const Tokenizer& tok, const Corpus& c, double total_mb) {
  Measure m;
  m.passes = static_cast<size_t>(total_mb * 1e6 / static_cast<double>(c.bytes)) + 1;
  auto t0 = std::chrono::steady_clock::now();
  double cpu0 = thread_cpu_seconds();
  for (size_t p = 0; p < m.passes; ++p) {
    for (const std::string& text : c.texts) {
      Result<std::vector<int32_t>> ids = tok.encode(text);
      if (!ids.ok()) {
        fmt::print(stderr, "encode failed: {}\n", ids.error().to_string());
        std::exit(2);
      }
      m.tokens += ids->size();
    }
  }
  m.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  m.cpu_seconds = thread_cpu_seconds() - cpu0;
  return m;
}

}  // namespace

int main(int argc, char** argv) {
  double total_mb = 50;
  CLI::App app{
      "Tokenizer encode throughput (the real-vocabulary tiny model's tokenizer.json) on one\n"
      "thread over the English (\"license-en\"), code and CJK cases of\n"
      "tests/data/tokenizer-qwen3/encode.jsonl, each case encoded as its own call, repeated\n"
      "until at least --mb megabytes went through. Target: >= 10 MB/s for English. \"cold\" has\n"
      "the piece cache disabled (every piece goes through BPE merging); \"warm\" uses the cache\n"
      "after one untimed pass, as a long-running server would. The ratio to the target uses\n"
      "wall-clock MB/s."};
  app.option_defaults()->always_capture_default();
  app.add_option("--mb", total_mb, "megabytes (1e6 bytes) encoded per figure, at least")
      ->check(CLI::Range(0.0, 1e6));
  CLI11_PARSE(app, argc, argv);
  std::string model = std::string(RECUR_SOURCE_DIR) + "/models/qwen3next-tiny-realvocab";
  TokenizerOptions no_cache;
  no_cache.word_cache = false;
  auto t0 = std::chrono::steady_clock::now();
  Result<Tokenizer> cold = Tokenizer::load(model, no_cache);
  double load_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  Result<Tokenizer> warm = Tokenizer::load(model);
  if (!cold.ok() || !warm.ok()) {
    fmt::print(stderr, "cannot load tokenizer: {}\n",
               (!cold.ok() ? cold : warm).error().to_string());
    return 2;
  }
  fmt::print(
      "bench_tokenizer: Tokenizer::encode, 1 thread, {} (tokenizer.json loaded in {:.2f} s)\n",
      model, load_s);
  fmt::print(
      "each case encoded as one call; >= {:.0f} MB per figure; MB = 1e6 bytes of UTF-8 input\n",
      total_mb);
  fmt::print(
      "MB/s is wall-clock; cpu MB/s divides by this thread's CPU time (differs when the "
      "machine is shared)\n");
  fmt::print("{:<11} {:<5} {:>6} {:>6} {:>7} {:>6} {:>8} {:>7} {:>7} {:>9} {:>10}\n", "corpus",
             "cache", "bytes", "cases", "passes", "MB", "seconds", "tokens", "MB/s", "cpu MB/s",
             "vs 10MB/s");
  for (const Corpus& c : load_corpora()) {
    if (c.bytes == 0) continue;
    measure(*warm, c, 0.0);  // one untimed pass fills the cache
    for (bool use_cache : {false, true}) {
      Measure m = measure(use_cache ? *warm : *cold, c, total_mb);
      double mb = static_cast<double>(c.bytes * m.passes) / 1e6;
      double mbps = mb / m.seconds;
      fmt::print(
          "{:<11} {:<5} {:>6} {:>6} {:>7} {:>6.1f} {:>8.2f} {:>6.1f}M {:>7.1f} {:>9.1f} "
          "{:>9.2f}x\n",
          c.name, use_cache ? "warm" : "cold", c.bytes, c.texts.size(), m.passes, mb, m.seconds,
          static_cast<double>(m.tokens) / 1e6, mbps, mb / m.cpu_seconds, mbps / kTargetMBps);
    }
  }
  return 0;
}
