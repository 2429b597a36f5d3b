// Prometheus text output: HELP/TYPE before samples, cumulative histogram buckets ending in
// +Inf equal to _count, and the engine's gauges.
#include <gtest/gtest.h>

#include <sstream>

#include "server/metrics.h"

namespace recur::server {
namespace {

std::string value_of(const std::string& text, const std::string& series) {
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(series + " ", 0) == 0) return line.substr(series.size() + 1);
  }
  return "<missing>";
}

TEST(Metrics, HistogramBucketsAreCumulative) {
  Histogram h({0.1, 1.0, 10.0});
  for (double v : {0.05, 0.1, 0.5, 5.0, 50.0}) h.observe(v);
  std::string out;
  h.render(&out, "x_seconds", "help text");
  EXPECT_EQ(out,
            "# HELP x_seconds help text\n# TYPE x_seconds histogram\n"
            "x_seconds_bucket{le=\"0.1\"} 2\nx_seconds_bucket{le=\"1\"} 3\n"
            "x_seconds_bucket{le=\"10\"} 4\nx_seconds_bucket{le=\"+Inf\"} 5\n"
            "x_seconds_sum 55.65\nx_seconds_count 5\n");
}

TEST(Metrics, RenderCarriesEngineGaugesAndCounters) {
  Metrics m;
  m.http_request("/v1/completions", 200);
  m.http_request("/v1/completions", 200);
  m.http_request("other", 404);
  m.request_started("chat");
  m.request_finished("stop");
  m.request_finished("abort");
  m.client_disconnected();
  m.ttft.observe(0.02);
  EngineStats s;
  s.running = 3;
  s.waiting = 2;
  s.kv_blocks_used = 10;
  s.kv_blocks_total = 100;
  s.slots_used = 3;
  s.slots_total = 8;
  s.alloc.live_buffers = 42;
  s.alloc.live_bytes = 1 << 20;
  s.generated_tokens = 77;
  s.steps = 40;
  s.pipelined_steps = 31;
  s.preemptions = 3;
  s.prefix_queries = 5;
  s.prefix_query_tokens = 900;
  s.prefix_hit_tokens = 640;
  s.prefix_blocks = 50;
  s.prefix_snapshots = 4;
  s.prefix_snapshots_total = 16;
  s.prefix_snapshot_bytes = 1000;
  s.prefix_evictions = 6;
  s.prefix_snapshot_evictions = 2;
  const std::string text = m.render(s);
  EXPECT_EQ(value_of(text, R"(recur_http_requests_total{route="/v1/completions",code="200"})"),
            "2");
  EXPECT_EQ(value_of(text, R"(recur_http_requests_total{route="other",code="404"})"), "1");
  EXPECT_EQ(value_of(text, R"(recur_requests_total{endpoint="chat"})"), "1");
  EXPECT_EQ(value_of(text, R"(recur_requests_total{endpoint="messages"})"), "0");
  EXPECT_EQ(value_of(text, R"(recur_sequences_finished_total{finish_reason="abort"})"), "1");
  EXPECT_EQ(value_of(text, "recur_client_disconnects_total"), "1");
  EXPECT_EQ(value_of(text, "recur_num_requests_running"), "3");
  EXPECT_EQ(value_of(text, "recur_num_requests_waiting"), "2");
  EXPECT_EQ(value_of(text, "recur_kv_cache_blocks_used"), "10");
  EXPECT_EQ(value_of(text, "recur_state_slots_used"), "3");
  EXPECT_EQ(value_of(text, "recur_live_buffers"), "42");
  EXPECT_EQ(value_of(text, "recur_live_bytes"), "1048576");
  EXPECT_EQ(value_of(text, "recur_generation_tokens_total"), "77");
  EXPECT_EQ(value_of(text, "recur_engine_steps_total"), "40");
  EXPECT_EQ(value_of(text, "recur_engine_pipelined_steps_total"), "31");
  EXPECT_EQ(value_of(text, "recur_preemptions_total"), "3");
  EXPECT_EQ(value_of(text, "recur_time_to_first_token_seconds_count"), "1");
  EXPECT_EQ(value_of(text, "recur_prefix_cache_queries_total"), "5");
  EXPECT_EQ(value_of(text, "recur_prefix_cache_query_tokens_total"), "900");
  EXPECT_EQ(value_of(text, "recur_prefix_cache_hit_tokens_total"), "640");
  EXPECT_EQ(value_of(text, "recur_prefix_cache_blocks"), "50");
  EXPECT_EQ(value_of(text, "recur_prefix_cache_snapshots"), "4");
  EXPECT_EQ(value_of(text, "recur_prefix_cache_snapshots_total"), "16");
  EXPECT_EQ(value_of(text, "recur_prefix_cache_snapshot_bytes"), "4000");
  EXPECT_EQ(value_of(text, "recur_prefix_cache_evictions_total"), "6");
  EXPECT_EQ(value_of(text, "recur_prefix_cache_snapshot_evictions_total"), "2");
  EXPECT_EQ(text.back(), '\n');
}

}  // namespace
}  // namespace recur::server
