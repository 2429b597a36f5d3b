// Time of Sampler::sample() per token at the Qwen vocabulary for common settings; the
// description in main() is what --help prints.
#include <fmt/format.h>
#include <CLI/CLI.hpp>

#include <algorithm>
#include <chrono>
#include <random>
#include <string>
#include <vector>

#include "engine/sampler.h"

using namespace recur;

int main(int argc, char** argv) {
  constexpr int kVocab = 151936, kIters = 2000;
  int n_rows = 8;
  std::string filter;
  CLI::App app{
      "Time of Sampler::sample() per token at the Qwen vocabulary (151,936) for common settings\n"
      "(greedy, temperature with top-k, top-p or min-p, logprobs, repetition and presence\n"
      "penalties against a 2,000-token prompt): the median and the fastest of 2,000 calls each,\n"
      "on one thread. Logits: N(0, 2²) plus a peaked head, in distinct rows cycled so they are\n"
      "not all in L1/L2."};
  app.option_defaults()->always_capture_default();
  app.add_option("rows", n_rows, "distinct logit rows cycled (1: the logits stay cached)")
      ->check(CLI::Range(1, 1024));
  app.add_option("name-filter", filter, "time only the settings whose name contains this");
  CLI11_PARSE(app, argc, argv);
  std::mt19937_64 rng(1);
  std::normal_distribution<float> normal(0.0f, 2.0f);
  std::vector<std::vector<float>> rows(n_rows, std::vector<float>(kVocab));
  for (auto& r : rows) {
    for (float& x : r) x = normal(rng);
    for (int i = 0; i < 50; ++i) r[rng() % kVocab] = 10.0f + normal(rng);  // a plausible head
  }
  std::vector<int32_t> prompt(2000);
  for (int32_t& t : prompt) t = int32_t(rng() % kVocab);

  struct Config {
    const char* name;
    SamplingParams p;
  };
  std::vector<Config> configs;
  auto add = [&](const char* name, auto set) {
    SamplingParams p;
    set(p);
    configs.push_back({name, p});
  };
  add("greedy", [](SamplingParams& p) { p.temperature = 0; });
  add("greedy, logprobs=5", [](SamplingParams& p) { p.temperature = 0, p.logprobs = 5; });
  add("T=0.7 top_k=20", [](SamplingParams& p) { p.temperature = 0.7f, p.top_k = 20; });
  add("T=0.7 top_p=0.8", [](SamplingParams& p) { p.temperature = 0.7f, p.top_p = 0.8f; });
  add("T=1.0 top_p=0.95", [](SamplingParams& p) { p.top_p = 0.95f; });
  add("T=1.0 min_p=0.05", [](SamplingParams& p) { p.min_p = 0.05f; });
  add("T=1.0 plain", [](SamplingParams& p) {});
  add("T=0.7 top_k=20 top_p=0.8 logprobs=5", [](SamplingParams& p) {
    p.temperature = 0.7f, p.top_k = 20, p.top_p = 0.8f, p.logprobs = 5;
  });
  add("T=0.7 top_p=0.8 logprobs=5 rep=1.1 pres=0.5 (2000-token prompt)", [](SamplingParams& p) {
    p.temperature = 0.7f, p.top_p = 0.8f, p.logprobs = 5, p.repetition_penalty = 1.1f,
    p.presence_penalty = 0.5f;
  });

  fmt::print("Sampler::sample(), vocab {}, {} iterations each over {} logit rows, single thread\n",
             kVocab, kIters, n_rows);
  std::vector<float> work(kVocab);
  for (const Config& c : configs) {
    if (std::string(c.name).find(filter) == std::string::npos) continue;
    Sampler s(c.p, kVocab, 42);
    s.set_prompt(prompt);
    SampledToken out;
    const bool copies = c.p.repetition_penalty != 1;  // penalties edit logits: restore each step
    std::vector<double> times;
    times.reserve(kIters);
    int64_t checksum = 0;
    for (int it = 0; it < kIters; ++it) {
      std::vector<float>& r = rows[it % n_rows];
      if (copies) std::copy(r.begin(), r.end(), work.begin());
      float* l = copies ? work.data() : r.data();
      const auto t0 = std::chrono::steady_clock::now();
      s.sample(l, &out);
      const double us =
          std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
      s.accept(out.id);
      times.push_back(us);
      checksum += out.id;
    }
    std::sort(times.begin(), times.end());
    fmt::print("  {:<62} median {:7.1f} us  min {:7.1f} us  (checksum {})\n", c.name,
               times[times.size() / 2], times[0], checksum);
  }
}
