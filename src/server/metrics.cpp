#include "server/metrics.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

namespace recur::server {

namespace {

// Prometheus floats: shortest round-trip text; integers without a fraction.
std::string num(double v) {
  if (std::isnan(v)) return "NaN";
  if (std::isinf(v)) return v > 0 ? "+Inf" : "-Inf";
  return fmt::format("{}", v);
}

void header(std::string* out, std::string_view name, std::string_view type, std::string_view help) {
  fmt::format_to(std::back_inserter(*out), "# HELP {} {}\n# TYPE {} {}\n", name, help, name, type);
}

void scalar(std::string* out, std::string_view name, std::string_view type, std::string_view help,
            double value) {
  header(out, name, type, help);
  fmt::format_to(std::back_inserter(*out), "{} {}\n", name, num(value));
}

// Label values escape backslash, double quote and newline.
std::string escape(std::string_view s) {
  std::string out;
  for (char c : s) {
    if (c == '\\' || c == '"') {
      out += '\\';
      out += c;
    } else if (c == '\n') {
      out += "\\n";
    } else {
      out += c;
    }
  }
  return out;
}

}  // namespace

Histogram::Histogram(std::vector<double> upper_bounds)
    : bounds_(std::move(upper_bounds)), counts_(bounds_.size() + 1, 0) {
  std::sort(bounds_.begin(), bounds_.end());
}

void Histogram::observe(double v) {
  if (!std::isfinite(v)) return;
  const size_t b = size_t(std::lower_bound(bounds_.begin(), bounds_.end(), v) - bounds_.begin());
  std::lock_guard<std::mutex> lk(mu_);
  counts_[b]++;
  sum_ += v;
  count_++;
}

void Histogram::render(std::string* out, std::string_view name, std::string_view help) const {
  std::vector<uint64_t> counts;
  double sum;
  uint64_t count;
  {
    std::lock_guard<std::mutex> lk(mu_);
    counts = counts_;
    sum = sum_;
    count = count_;
  }
  header(out, name, "histogram", help);
  uint64_t cumulative = 0;
  for (size_t i = 0; i < bounds_.size(); ++i) {
    cumulative += counts[i];
    fmt::format_to(std::back_inserter(*out), "{}_bucket{{le=\"{}\"}} {}\n", name, num(bounds_[i]),
                   cumulative);
  }
  fmt::format_to(std::back_inserter(*out), "{}_bucket{{le=\"+Inf\"}} {}\n", name, count);
  fmt::format_to(std::back_inserter(*out), "{}_sum {}\n{}_count {}\n", name, num(sum), name, count);
}

Metrics::Metrics()
    : ttft({0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1,  0.25,
            0.5,   0.75,   1.0,   2.5,  5.0,  7.5,  10.0, 20.0, 40.0, 80.0}),
      tpot({0.0005, 0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05,
            0.075,  0.1,   0.15,   0.2,   0.3,  0.4,   0.5,  0.75,  1.0,  2.5}),
      e2e({0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0, 600.0}),
      cancel_steps({0, 1, 2, 4, 8, 16}) {}

void Metrics::http_request(std::string_view route, int status) {
  std::lock_guard<std::mutex> lk(mu_);
  http_[{std::string(route), status}]++;
}

void Metrics::connection_closed(std::string_view reason) {
  std::lock_guard<std::mutex> lk(mu_);
  closed_[std::string(reason)]++;
}

void Metrics::request_started(std::string_view endpoint) {
  std::lock_guard<std::mutex> lk(mu_);
  started_[std::string(endpoint)]++;
}

void Metrics::request_finished(std::string_view finish_reason) {
  std::lock_guard<std::mutex> lk(mu_);
  finished_[std::string(finish_reason)]++;
}

std::string Metrics::render(const EngineStats& s) const {
  std::string out;
  out.reserve(8192);
  {
    std::lock_guard<std::mutex> lk(mu_);
    header(&out, "recur_http_requests_total", "counter",
           "HTTP requests answered, by route and status code.");
    for (const auto& [key, n] : http_) {
      fmt::format_to(std::back_inserter(out),
                     "recur_http_requests_total{{route=\"{}\",code=\"{}\"}} {}\n",
                     escape(key.first), key.second, n);
    }
    header(&out, "recur_requests_total", "counter", "Generation requests accepted, by endpoint.");
    for (const char* e : {"chat", "completions", "messages", "responses"}) {
      auto it = started_.find(e);
      fmt::format_to(std::back_inserter(out), "recur_requests_total{{endpoint=\"{}\"}} {}\n", e,
                     it == started_.end() ? 0 : it->second);
    }
    header(&out, "recur_sequences_finished_total", "counter",
           "Sequences (choices) finished, by finish reason.");
    for (const char* r : {"stop", "length", "abort", "error"}) {
      auto it = finished_.find(r);
      fmt::format_to(std::back_inserter(out),
                     "recur_sequences_finished_total{{finish_reason=\"{}\"}} {}\n", r,
                     it == finished_.end() ? 0 : it->second);
    }
    header(&out, "recur_http_connections_closed_total", "counter",
           "Connections the server closed itself, by reason (deadlines, the connection limit).");
    for (const char* r : {"idle_timeout", "header_timeout", "body_timeout", "write_timeout",
                          "evicted", "refused"}) {
      auto it = closed_.find(r);
      fmt::format_to(std::back_inserter(out),
                     "recur_http_connections_closed_total{{reason=\"{}\"}} {}\n", r,
                     it == closed_.end() ? 0 : it->second);
    }
  }
  scalar(&out, "recur_http_connections", "gauge", "Open client connections.",
         double(connections_.load()));
  scalar(&out, "recur_client_disconnects_total", "counter",
         "Requests whose client went away before the end; their sequences were cancelled.",
         double(disconnects_.load()));
  scalar(&out, "recur_http_requests_in_flight", "gauge",
         "HTTP request handlers running (a stream's handler returns as its stream starts).",
         double(in_flight_.load()));
  scalar(&out, "recur_prompt_tokens_total", "counter", "Prompt tokens prefilled.",
         double(s.prompt_tokens));
  scalar(&out, "recur_generation_tokens_total", "counter", "Tokens generated.",
         double(s.generated_tokens));
  scalar(&out, "recur_engine_steps_total", "counter", "Engine scheduler steps.", double(s.steps));
  scalar(&out, "recur_engine_pipelined_steps_total", "counter",
         "Decode steps queued before the previous step's picks were read (greedy, on a GPU).",
         double(s.pipelined_steps));
  scalar(&out, "recur_engine_requests_finished_total", "counter",
         "Sequences the engine has finished and released.", double(s.requests_finished));
  scalar(&out, "recur_engine_failed_steps_total", "counter",
         "Engine steps that threw (memory exhausted, say); their requests ended with an error.",
         double(s.failed_steps));
  scalar(&out, "recur_preemptions_total", "counter",
         "Running sequences preempted for lack of attention-cache blocks (resumed by "
         "recomputation).",
         double(s.preemptions));
  ttft.render(&out, "recur_time_to_first_token_seconds",
              "Time from request arrival to the first generated token.");
  tpot.render(&out, "recur_time_per_output_token_seconds",
              "Mean time per generated token after the first, per sequence.");
  e2e.render(&out, "recur_e2e_request_latency_seconds",
             "Time from request arrival to the last token, per sequence.");
  cancel_steps.render(&out, "recur_disconnect_cancel_steps",
                      "Engine steps between a client disconnect and the release of its sequence.");
  scalar(&out, "recur_num_requests_running", "gauge", "Sequences running in the engine.",
         s.running);
  scalar(&out, "recur_num_requests_waiting", "gauge", "Sequences queued in the engine.", s.waiting);
  scalar(&out, "recur_kv_cache_blocks_used", "gauge", "Attention-cache blocks in use.",
         s.kv_blocks_used);
  scalar(&out, "recur_kv_cache_blocks_total", "gauge", "Attention-cache blocks in the pool.",
         s.kv_blocks_total);
  scalar(&out, "recur_state_slots_used", "gauge", "Recurrent-state slots in use.", s.slots_used);
  scalar(&out, "recur_state_slots_total", "gauge", "Recurrent-state slots in the pool.",
         s.slots_total);
  scalar(&out, "recur_prefix_cache_queries_total", "counter",
         "Requests that looked their prompt up in the prefix cache.", double(s.prefix_queries));
  scalar(&out, "recur_prefix_cache_query_tokens_total", "counter",
         "Prompt tokens of the requests looked up in the prefix cache.",
         double(s.prefix_query_tokens));
  scalar(&out, "recur_prefix_cache_hit_tokens_total", "counter",
         "Prompt tokens read from the prefix cache instead of prefilled.",
         double(s.prefix_hit_tokens));
  scalar(&out, "recur_prefix_cache_blocks", "gauge",
         "Attention-cache blocks the prefix cache holds (shared or kept for reuse).",
         s.prefix_blocks);
  scalar(&out, "recur_prefix_cache_snapshots", "gauge", "Recurrent-state snapshots held.",
         s.prefix_snapshots);
  scalar(&out, "recur_prefix_cache_snapshots_total", "gauge", "Snapshot slots in the pool.",
         s.prefix_snapshots_total);
  scalar(&out, "recur_prefix_cache_snapshot_bytes", "gauge", "Bytes of the snapshots held.",
         double(s.prefix_snapshot_bytes) * s.prefix_snapshots);
  scalar(&out, "recur_prefix_cache_evictions_total", "counter",
         "Prefix-cache blocks evicted (with their snapshots) for running sequences.",
         double(s.prefix_evictions));
  scalar(&out, "recur_prefix_cache_snapshot_evictions_total", "counter",
         "Snapshots replaced by newer ones when the pool was full.",
         double(s.prefix_snapshot_evictions));
  scalar(&out, "recur_live_buffers", "gauge", "Backend buffer objects allocated and not freed.",
         double(s.alloc.live_buffers));
  scalar(&out, "recur_live_bytes", "gauge", "Bytes of live backend buffers.",
         double(s.alloc.live_bytes));
  scalar(&out, "recur_peak_bytes", "gauge", "Peak bytes of live backend buffers.",
         double(s.alloc.peak_bytes));
  scalar(&out, "recur_allocations_total", "counter", "Backend buffer allocations ever made.",
         double(s.alloc.allocs_total));
  return out;
}

}  // namespace recur::server
