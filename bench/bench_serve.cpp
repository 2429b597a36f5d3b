// Load benchmark of `recur serve`: N concurrent streaming clients, each sending R requests of
// P prompt tokens and O output tokens in turn, over plain sockets (a light client, so the
// 2-core machine measures the server). Then the same work through an in-process Engine with the
// same configuration, in the same run, and the ratio of output tokens per second.
//   bench_serve [--recur build/recur] [--model DIR] [--clients 32] [--requests 4]
//               [--prompt-tokens 128] [--output-tokens 128] [--max-batch 32] [--threads N]
//               [--greedy]
// Soak mode (bench/bench_serve_soak.sh): --soak SECONDS --cancel-prob P, 64 clients by default,
// then checks that /metrics is back to its idle values and that no request was lost.
#include <arpa/inet.h>
#include <fmt/format.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <map>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "backend/cpu/cpu_ops.h"
#include "engine/engine.h"

using namespace recur;
using Clock = std::chrono::steady_clock;

namespace {

struct Options {
  std::string recur = std::string(RECUR_SOURCE_DIR) + "/build/recur";
  std::string model = std::string(RECUR_SOURCE_DIR) + "/models/qwen3next-tiny-realvocab";
  int clients = 32, requests = 4, prompt_tokens = 128, output_tokens = 128, max_batch = 32;
  int threads = 0;
  int rounds = 3;  // server and engine runs alternate, so both see the same machine load
  bool greedy = false;
  double soak_seconds = 0, cancel_prob = 0.2;
};

struct Sample {
  double ttft = 0, tpot = 0;
  int tokens = 0;
  bool complete = false;  // saw finish_reason and [DONE]
};

double pct(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, size_t(p * double(v.size() - 1) + 0.5))];
}

std::vector<int32_t> prompt_for(int client, int request, int n) {
  std::mt19937 rng(uint32_t(client * 7919 + request * 104729 + 1));
  std::vector<int32_t> ids(static_cast<size_t>(n), 0);
  for (auto& id : ids) id = int32_t(1 + rng() % 150000);
  return ids;
}

// ---- A minimal HTTP/1.1 client: one connection per request, chunked SSE parsed in place ----

int connect_to(int port) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(uint16_t(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) {
    close(fd);
    return -1;
  }
  const int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  return fd;
}

bool send_all(int fd, const std::string& s) {
  size_t at = 0;
  while (at < s.size()) {
    const ssize_t n = send(fd, s.data() + at, s.size() - at, MSG_NOSIGNAL);
    if (n <= 0) return false;
    at += size_t(n);
  }
  return true;
}

std::string http_get(int port, const std::string& path) {
  const int fd = connect_to(port);
  if (fd < 0) return "";
  send_all(fd, "GET " + path + " HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
  std::string out;
  char buf[65536];
  for (ssize_t n; (n = recv(fd, buf, sizeof(buf), 0)) > 0;) out.append(buf, size_t(n));
  close(fd);
  const size_t body = out.find("\r\n\r\n");
  return body == std::string::npos ? "" : out.substr(body + 4);
}

// Streams one completion; `cancel_after` > 0 closes the connection after that many tokens.
Sample stream_request(int port, const std::vector<int32_t>& prompt, int max_tokens, bool greedy,
                      int cancel_after) {
  Sample s;
  std::string ids;
  for (size_t i = 0; i < prompt.size(); ++i) {
    if (i) ids += ',';
    ids += std::to_string(prompt[i]);
  }
  const std::string body = fmt::format(
      R"({{"prompt":[{}],"max_tokens":{},"ignore_eos":true,"stream":true,"return_token_ids":true{}}})",
      ids, max_tokens, greedy ? R"(,"temperature":0)" : "");
  const int fd = connect_to(port);
  if (fd < 0) return s;
  const auto t0 = Clock::now();
  if (!send_all(fd,
                fmt::format("POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                            "application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{}",
                            body.size(), body))) {
    close(fd);
    return s;
  }
  std::string raw;  // everything received; chunk framing is skipped by searching for events
  size_t scan = 0;
  Clock::time_point first, last;
  bool finished = false, done = false;
  char buf[16384];
  while (!done) {
    const ssize_t n = recv(fd, buf, sizeof(buf), 0);
    if (n <= 0) break;
    raw.append(buf, size_t(n));
    const auto now = Clock::now();
    for (size_t at; (at = raw.find("data: ", scan)) != std::string::npos;) {
      const size_t end = raw.find("\n\n", at);
      if (end == std::string::npos) break;
      const std::string_view ev(raw.data() + at + 6, end - at - 6);
      scan = end + 2;
      if (ev == "[DONE]") {
        done = true;
        break;
      }
      const size_t t = ev.find("\"token_ids\":[");
      if (t != std::string::npos && ev[t + 13] != ']') {
        const size_t close_at = ev.find(']', t);
        const int k = int(std::count(ev.begin() + long(t), ev.begin() + long(close_at), ',')) + 1;
        if (s.tokens == 0) first = now;
        last = now;
        s.tokens += k;
      }
      if (ev.find("\"finish_reason\":\"") != std::string::npos) finished = true;
    }
    if (cancel_after > 0 && s.tokens >= cancel_after) break;
  }
  close(fd);
  s.complete = finished && done;
  if (s.tokens > 0) s.ttft = std::chrono::duration<double>(first - t0).count();
  if (s.tokens > 1) s.tpot = std::chrono::duration<double>(last - first).count() / (s.tokens - 1);
  return s;
}

// ---- The server as a child process ----

struct Child {
  pid_t pid = -1;
  int port = -1;
};

Child start_server(const Options& o) {
  int out[2];
  if (pipe(out) != 0) std::exit(2);
  const pid_t pid = fork();
  if (pid == 0) {
    dup2(out[1], 1);
    close(out[0]);
    std::vector<std::string> args = {o.recur,  "serve", "--model",     o.model,
                                     "--port", "0",     "--max-batch", std::to_string(o.max_batch)};
    if (o.threads > 0) args.insert(args.end(), {"--threads", std::to_string(o.threads)});
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    execv(argv[0], argv.data());
    _exit(127);
  }
  close(out[1]);
  std::string text;
  char buf[4096];
  Child c;
  c.pid = pid;
  for (ssize_t n; c.port < 0 && (n = read(out[0], buf, sizeof(buf))) > 0;) {
    text.append(buf, size_t(n));
    const size_t at = text.find("http://127.0.0.1:");
    if (at != std::string::npos && text.find(' ', at) != std::string::npos) {
      c.port = std::atoi(text.c_str() + at + 17);
    }
  }
  // Keep draining its stdout so it never blocks on a full pipe.
  std::thread([fd = out[0]] {
    char b[4096];
    while (read(fd, b, sizeof(b)) > 0) {
    }
    close(fd);
  }).detach();
  if (c.port < 0) {
    fmt::print(stderr, "the server did not start:\n{}\n", text);
    std::exit(2);
  }
  return c;
}

int stop_server(const Child& c) {
  kill(c.pid, SIGTERM);
  int status = 0;
  waitpid(c.pid, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

double metric(const std::string& text, const std::string& series) {
  const size_t at = text.find("\n" + series + " ");
  return at == std::string::npos ? -1 : std::atof(text.c_str() + at + series.size() + 2);
}

struct Report {
  double seconds = 0;
  int requests = 0;
  int64_t tokens = 0;
  std::vector<double> ttft, tpot;
};

void print(const char* what, const Report& r) {
  fmt::print(
      "{:<12} requests/s {:8.2f}   output tok/s {:9.1f}   TTFT p50 {:7.1f} ms p99 {:7.1f} ms"
      "   TPOT p50 {:6.2f} ms p99 {:6.2f} ms   ({} requests, {} tokens, {:.2f} s)\n",
      what, r.requests / r.seconds, double(r.tokens) / r.seconds, 1e3 * pct(r.ttft, 0.5),
      1e3 * pct(r.ttft, 0.99), 1e3 * pct(r.tpot, 0.5), 1e3 * pct(r.tpot, 0.99), r.requests,
      r.tokens, r.seconds);
}

Report run_server_load(const Options& o, int port) {
  Report r;
  std::mutex mu;
  std::atomic<int> incomplete{0};
  const auto t0 = Clock::now();
  std::vector<std::thread> clients;
  for (int c = 0; c < o.clients; ++c) {
    clients.emplace_back([&, c] {
      for (int q = 0; q < o.requests; ++q) {
        Sample s =
            stream_request(port, prompt_for(c, q, o.prompt_tokens), o.output_tokens, o.greedy, 0);
        if (!s.complete || s.tokens != o.output_tokens) ++incomplete;
        std::lock_guard<std::mutex> lk(mu);
        r.requests++;
        r.tokens += s.tokens;
        r.ttft.push_back(s.ttft);
        r.tpot.push_back(s.tpot);
      }
    });
  }
  for (auto& t : clients) t.join();
  r.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  if (incomplete) fmt::print("WARNING: {} requests did not complete in full\n", incomplete.load());
  return r;
}

// The same closed-loop work through an in-process engine: each virtual client submits its
// next request when the previous one finishes.
Report run_engine_alone(const Options& o) {
  auto tok = Tokenizer::load(o.model);
  if (!tok.ok()) std::exit(2);
  CpuOps ops(o.threads > 0 ? o.threads : default_thread_count());
  EngineConfig cfg;
  cfg.max_batch = o.max_batch;
  cfg.max_batch_tokens = std::max(512, o.max_batch);
  auto e = Engine::create(o.model, ops, cfg, &*tok);
  if (!e.ok()) {
    fmt::print(stderr, "error: {}\n", e.error().to_string());
    std::exit(2);
  }
  Engine& eng = **e;
  const GenerationDefaults& gd = eng.model_info().generation;
  SamplingParams sp;
  if (!o.greedy) {
    sp.temperature = gd.do_sample ? gd.temperature : 0.0f;
    sp.top_k = gd.do_sample ? gd.top_k : 0;
    sp.top_p = gd.do_sample ? gd.top_p : 1.0f;
    sp.min_p = gd.do_sample ? gd.min_p : 0.0f;
  } else {
    sp.temperature = 0;
  }
  sp.repetition_penalty = gd.repetition_penalty;

  Report r;
  std::mutex mu;
  std::condition_variable cv;
  std::vector<int> finished_clients;  // clients whose request just finished
  int outstanding = 0;
  struct Timing {
    Clock::time_point sent, first, last;
    int tokens = 0;
  };
  std::vector<Timing> timing(size_t(o.clients));
  std::vector<int> next(size_t(o.clients), 0);
  auto submit = [&](int c) {
    Request req;
    req.prompt = prompt_for(c, next[size_t(c)]++, o.prompt_tokens);
    req.max_tokens = o.output_tokens;
    req.sampling = sp;
    req.stop.ignore_eos = true;
    timing[size_t(c)] = Timing{Clock::now(), {}, {}, 0};
    ++outstanding;
    auto id = eng.submit(std::move(req), [&, c](const Event& ev) {
      Timing& t = timing[size_t(c)];
      if (ev.kind == Event::Kind::kToken) {
        if (t.tokens++ == 0) t.first = Clock::now();
        t.last = Clock::now();
        return;
      }
      std::lock_guard<std::mutex> lk(mu);
      finished_clients.push_back(c);
      cv.notify_one();
    });
    if (!id.ok()) std::exit(2);
  };
  const auto t0 = Clock::now();
  {
    std::lock_guard<std::mutex> lk(mu);
    for (int c = 0; c < o.clients; ++c) submit(c);
  }
  eng.start();
  std::unique_lock<std::mutex> lk(mu);
  while (outstanding > 0) {
    cv.wait(lk, [&] { return !finished_clients.empty(); });
    std::vector<int> done;
    done.swap(finished_clients);
    for (int c : done) {
      --outstanding;
      const Timing& t = timing[size_t(c)];
      r.requests++;
      r.tokens += t.tokens;
      r.ttft.push_back(std::chrono::duration<double>(t.first - t.sent).count());
      if (t.tokens > 1) {
        r.tpot.push_back(std::chrono::duration<double>(t.last - t.first).count() / (t.tokens - 1));
      }
      if (next[size_t(c)] < o.requests) submit(c);
    }
  }
  r.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  return r;
}

// Soak: clients stream continuously and cancel at random; afterwards the server must be idle
// (slots and blocks 0, live buffers back to the idle count) and have lost no request.
int soak(const Options& o, int port) {
  const std::string idle = http_get(port, "/metrics");
  const double idle_buffers = metric(idle, "recur_live_buffers");
  std::atomic<int64_t> sent{0}, completed{0}, cancelled{0}, failed{0}, tokens{0};
  const auto deadline = Clock::now() + std::chrono::duration<double>(o.soak_seconds);
  std::vector<std::thread> clients;
  for (int c = 0; c < o.clients; ++c) {
    clients.emplace_back([&, c] {
      std::mt19937 rng(uint32_t(c + 1));
      for (int q = 0; Clock::now() < deadline; ++q) {
        const int plen = 8 + int(rng() % uint32_t(o.prompt_tokens));
        const int olen = 1 + int(rng() % uint32_t(o.output_tokens));
        const bool cancel = std::uniform_real_distribution<double>(0, 1)(rng) < o.cancel_prob;
        const int cancel_after = cancel ? 1 + int(rng() % uint32_t(olen)) : 0;
        ++sent;
        Sample s = stream_request(port, prompt_for(c, q, plen), olen, false, cancel_after);
        tokens += s.tokens;
        if (cancel && s.tokens >= cancel_after && !s.complete) {
          ++cancelled;
        } else if (s.complete && s.tokens == olen) {
          ++completed;
        } else {
          ++failed;
        }
      }
    });
  }
  for (auto& t : clients) t.join();
  // Cancelled sequences are released within a step; give the engine a moment to go idle.
  std::string m;
  for (int i = 0; i < 100; ++i) {
    m = http_get(port, "/metrics");
    if (metric(m, "recur_state_slots_used") == 0 && metric(m, "recur_num_requests_running") == 0)
      break;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  auto series = [&](const char* s) { return metric(m, s); };
  const double accepted = series("recur_requests_total{endpoint=\"completions\"}");
  const double fin_stop = series("recur_sequences_finished_total{finish_reason=\"stop\"}");
  const double fin_len = series("recur_sequences_finished_total{finish_reason=\"length\"}");
  const double fin_abort = series("recur_sequences_finished_total{finish_reason=\"abort\"}");
  const double fin_err = series("recur_sequences_finished_total{finish_reason=\"error\"}");
  fmt::print(
      "soak: {:.0f} s, {} clients, cancel probability {}: sent {}, completed {}, "
      "cancelled by the client {}, failed {}, {} tokens streamed\n",
      o.soak_seconds, o.clients, o.cancel_prob, sent.load(), completed.load(), cancelled.load(),
      failed.load(), tokens.load());
  fmt::print(
      "server: accepted {:.0f}, finished stop {:.0f} length {:.0f} abort {:.0f} error {:.0f}, "
      "disconnects {:.0f}\n",
      accepted, fin_stop, fin_len, fin_abort, fin_err, series("recur_client_disconnects_total"));
  fmt::print(
      "after: slots used {:.0f}, blocks used {:.0f}, running {:.0f}, waiting {:.0f}, "
      "live buffers {:.0f} (idle {:.0f}), live bytes {:.0f}, in-flight HTTP {:.0f}\n",
      series("recur_state_slots_used"), series("recur_kv_cache_blocks_used"),
      series("recur_num_requests_running"), series("recur_num_requests_waiting"),
      series("recur_live_buffers"), idle_buffers, series("recur_live_bytes"),
      series("recur_http_requests_in_flight"));
  const bool idle_ok =
      series("recur_state_slots_used") == 0 && series("recur_kv_cache_blocks_used") == 0 &&
      series("recur_num_requests_running") == 0 && series("recur_num_requests_waiting") == 0 &&
      series("recur_live_buffers") == idle_buffers;
  // Every request the clients sent was accepted, and every accepted one has finished; the
  // client's count of full completions is the server's stop + length.
  const bool none_lost = accepted == double(sent.load()) &&
                         fin_stop + fin_len + fin_abort + fin_err == accepted && fin_err == 0 &&
                         failed.load() == 0 && fin_stop + fin_len >= double(completed.load());
  fmt::print("idle values restored: {}; no request lost: {}\n", idle_ok ? "yes" : "NO",
             none_lost ? "yes" : "NO");
  return idle_ok && none_lost ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  bool clients_given = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> std::string { return i + 1 < argc ? argv[++i] : ""; };
    if (a == "--recur")
      o.recur = next();
    else if (a == "--model")
      o.model = next();
    else if (a == "--clients")
      o.clients = std::atoi(next().c_str()), clients_given = true;
    else if (a == "--requests")
      o.requests = std::atoi(next().c_str());
    else if (a == "--prompt-tokens")
      o.prompt_tokens = std::atoi(next().c_str());
    else if (a == "--output-tokens")
      o.output_tokens = std::atoi(next().c_str());
    else if (a == "--max-batch")
      o.max_batch = std::atoi(next().c_str());
    else if (a == "--threads")
      o.threads = std::atoi(next().c_str());
    else if (a == "--greedy")
      o.greedy = true;
    else if (a == "--rounds")
      o.rounds = std::max(1, std::atoi(next().c_str()));
    else if (a == "--soak")
      o.soak_seconds = std::atof(next().c_str());
    else if (a == "--cancel-prob")
      o.cancel_prob = std::atof(next().c_str());
    else {
      fmt::print(stderr, "unknown option {}\n", a);
      return 2;
    }
  }
  if (o.soak_seconds > 0 && !clients_given) o.clients = 64;
  if (o.soak_seconds > 0) o.max_batch = std::max(o.max_batch, 64);
  signal(SIGPIPE, SIG_IGN);
  fmt::print(
      "model {}\nclients {}, {} requests each, prompt {} tokens, output {} tokens, "
      "max batch {}, threads {}, {} sampling\n",
      o.model, o.clients, o.requests, o.prompt_tokens, o.output_tokens, o.max_batch,
      o.threads > 0 ? o.threads : default_thread_count(), o.greedy ? "greedy" : "default");
  const Child server = start_server(o);
  if (o.soak_seconds > 0) {
    const int rc = soak(o, server.port);
    const int exit_code = stop_server(server);
    fmt::print("server exit status after SIGTERM: {}\n", exit_code);
    return rc != 0 || exit_code != 0 ? 1 : 0;
  }
  stream_request(server.port, prompt_for(999, 0, 8), 4, o.greedy, 0);  // warm-up
  // The machine may be shared: alternate the two measurements and compare medians.
  std::vector<Report> served, alone;
  std::vector<double> ratios;
  for (int r = 0; r < o.rounds; ++r) {
    served.push_back(run_server_load(o, server.port));
    alone.push_back(run_engine_alone(o));
    const double ratio = (double(served.back().tokens) / served.back().seconds) /
                         (double(alone.back().tokens) / alone.back().seconds);
    ratios.push_back(ratio);
    fmt::print("round {}:\n", r + 1);
    print("recur serve", served.back());
    print("engine alone", alone.back());
    fmt::print("ratio {:.3f}\n", ratio);
    std::fflush(stdout);
  }
  const int exit_code = stop_server(server);
  auto median = [](std::vector<Report> v) {
    std::sort(v.begin(), v.end(), [](const Report& a, const Report& b) {
      return double(a.tokens) / a.seconds < double(b.tokens) / b.seconds;
    });
    return v[v.size() / 2];
  };
  fmt::print("median of {} rounds:\n", o.rounds);
  print("recur serve", median(served));
  print("engine alone", median(alone));
  fmt::print(
      "ratio (served / engine alone output tok/s), median of rounds: {:.3f} (min {:.3f}, max "
      "{:.3f})\n",
      pct(ratios, 0.5), pct(ratios, 0.0), pct(ratios, 1.0));
  fmt::print("server exit status after SIGTERM: {}\n", exit_code);
  return exit_code == 0 ? 0 : 1;
}
