// Server metrics in the Prometheus text exposition format: HTTP and generation counters,
// latency histograms, and the engine's gauges (sequences, cache blocks, slots, buffers).
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "engine/engine.h"

namespace recur::server {

class Histogram {
 public:
  explicit Histogram(std::vector<double> upper_bounds);
  void observe(double v);
  // # HELP / # TYPE, cumulative _bucket lines with le labels, _sum and _count.
  void render(std::string* out, std::string_view name, std::string_view help) const;

 private:
  std::vector<double> bounds_;
  mutable std::mutex mu_;
  std::vector<uint64_t> counts_;  // per bucket, not cumulative; last: +Inf
  double sum_ = 0;
  uint64_t count_ = 0;
};

class Metrics {
 public:
  Metrics();

  void http_request(std::string_view route, int status);
  void request_started(std::string_view endpoint);
  void request_finished(std::string_view finish_reason);  // one per sequence
  void client_disconnected() { disconnects_.fetch_add(1, std::memory_order_relaxed); }
  void http_in_flight(int delta) { in_flight_.fetch_add(delta, std::memory_order_relaxed); }
  void http_connections(int delta) { connections_.fetch_add(delta, std::memory_order_relaxed); }
  // Connections the server closed on its own: idle_timeout, header_timeout, body_timeout,
  // write_timeout, evicted (displaced at the connection limit), refused (503 at the limit).
  void connection_closed(std::string_view reason);

  Histogram ttft;  // seconds from request arrival to the first token
  Histogram tpot;  // seconds per output token after the first, per sequence
  Histogram e2e;   // seconds from arrival to the last token, per sequence
  // Engine steps completed between the cancel of a client that went away and its sequence's
  // release: 0, or 1 when a step was in flight (Event::cancel_steps).
  Histogram cancel_steps;

  std::string render(const EngineStats& stats) const;

 private:
  mutable std::mutex mu_;
  std::map<std::pair<std::string, int>, uint64_t> http_;
  std::map<std::string, uint64_t> started_;
  std::map<std::string, uint64_t> finished_;
  std::atomic<uint64_t> disconnects_{0};
  std::atomic<int> in_flight_{0};
  std::atomic<int> connections_{0};
  std::map<std::string, uint64_t> closed_;
};

}  // namespace recur::server
