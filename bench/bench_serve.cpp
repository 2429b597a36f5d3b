// Load benchmark of `recur serve` against the same work through an in-process Engine, and a
// soak mode with random cancellations (bench/bench_serve_soak.sh); the description in main() is
// what --help prints.
#include <arpa/inet.h>
#include <dirent.h>
#include <fmt/format.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <signal.h>
#include <sys/epoll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>
#include <CLI/CLI.hpp>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <fstream>
#include <map>
#include <memory>
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
  std::string client = "epoll";  // or "threads": a thread per connection
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

std::string request_text(const std::vector<int32_t>& prompt, int max_tokens, bool greedy) {
  std::string ids;
  for (size_t i = 0; i < prompt.size(); ++i) {
    if (i) ids += ',';
    ids += std::to_string(prompt[i]);
  }
  const std::string body = fmt::format(
      R"({{"prompt":[{}],"max_tokens":{},"ignore_eos":true,"stream":true,"return_token_ids":true{}}})",
      ids, max_tokens, greedy ? R"(,"temperature":0)" : "");
  return fmt::format(
      "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
      "Content-Length: {}\r\nConnection: close\r\n\r\n{}",
      body.size(), body);
}

// The events of one streamed response as they arrive; chunk framing is skipped by searching
// for events in everything received.
struct StreamParse {
  std::string raw;
  size_t scan = 0;
  Sample s;
  Clock::time_point sent, first, last;
  bool finished = false, done = false;

  void feed(const char* data, size_t n, Clock::time_point now) {
    raw.append(data, n);
    for (size_t at; !done && (at = raw.find("data: ", scan)) != std::string::npos;) {
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
  }

  Sample result() {
    s.complete = finished && done;
    if (s.tokens > 0) s.ttft = std::chrono::duration<double>(first - sent).count();
    if (s.tokens > 1) {
      s.tpot = std::chrono::duration<double>(last - first).count() / (s.tokens - 1);
    }
    return s;
  }
};

// Streams one completion on this thread; `cancel_after` > 0 closes the connection after that
// many tokens.
Sample stream_request(int port, const std::vector<int32_t>& prompt, int max_tokens, bool greedy,
                      int cancel_after) {
  const int fd = connect_to(port);
  if (fd < 0) return Sample{};
  StreamParse p;
  p.sent = Clock::now();
  if (!send_all(fd, request_text(prompt, max_tokens, greedy))) {
    close(fd);
    return Sample{};
  }
  char buf[16384];
  while (!p.done) {
    const ssize_t n = recv(fd, buf, sizeof(buf), 0);
    if (n <= 0) break;
    p.feed(buf, size_t(n), Clock::now());
    if (cancel_after > 0 && p.s.tokens >= cancel_after) break;
  }
  close(fd);
  return p.result();
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

// ---- Where the CPU goes: per-thread run time and context switches of the server process ----

struct ThreadTimes {
  std::string name;  // /proc comm
  double cpu_s = 0;  // run time (schedstat)
  int64_t voluntary = 0, involuntary = 0;
};

std::string read_text(const std::string& path) {
  std::ifstream in(path);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

// Every thread of `pid`, by thread id.
std::map<int, ThreadTimes> thread_times(pid_t pid) {
  std::map<int, ThreadTimes> out;
  const std::string dir = fmt::format("/proc/{}/task", pid);
  std::unique_ptr<DIR, int (*)(DIR*)> d(opendir(dir.c_str()), closedir);
  if (!d) return out;
  while (dirent* e = readdir(d.get())) {
    const int tid = std::atoi(e->d_name);
    if (tid <= 0) continue;
    const std::string t = dir + "/" + e->d_name;
    ThreadTimes tt;
    tt.name = read_text(t + "/comm");
    if (!tt.name.empty() && tt.name.back() == '\n') tt.name.pop_back();
    tt.cpu_s = std::atof(read_text(t + "/schedstat").c_str()) * 1e-9;
    const std::string status = read_text(t + "/status");
    auto field = [&](const char* key) -> int64_t {
      const size_t at = status.find(key);
      return at == std::string::npos ? 0 : std::atoll(status.c_str() + at + std::strlen(key));
    };
    tt.voluntary = field("voluntary_ctxt_switches:");
    tt.involuntary = field("nonvoluntary_ctxt_switches:");
    out[tid] = tt;
  }
  return out;
}

struct ProcessTimes {
  std::map<int, ThreadTimes> server;
  rusage client{};
};

ProcessTimes process_times(pid_t server) {
  ProcessTimes p;
  p.server = thread_times(server);
  getrusage(RUSAGE_SELF, &p.client);
  return p;
}

// CPU per 1,000 output tokens and context switches per token during the served run: the
// `compute` busiest server threads (the engine and its pool), the server's other threads
// grouped by name, and this process (the clients).
void print_cpu(const ProcessTimes& a, const ProcessTimes& b, int64_t tokens, int compute) {
  std::vector<ThreadTimes> delta;
  for (const auto& [tid, t1] : b.server) {
    ThreadTimes d = t1;
    if (auto it = a.server.find(tid); it != a.server.end()) {
      d.cpu_s -= it->second.cpu_s;
      d.voluntary -= it->second.voluntary;
      d.involuntary -= it->second.involuntary;
    }
    delta.push_back(d);
  }
  std::sort(delta.begin(), delta.end(),
            [](const ThreadTimes& x, const ThreadTimes& y) { return x.cpu_s > y.cpu_s; });
  std::map<std::string, ThreadTimes> groups;
  std::map<std::string, int> counts;
  for (size_t i = 0; i < delta.size(); ++i) {
    const std::string key =
        i < size_t(compute) ? "compute (busiest " + std::to_string(compute) + ")" : delta[i].name;
    ThreadTimes& g = groups[key];
    g.cpu_s += delta[i].cpu_s;
    g.voluntary += delta[i].voluntary;
    g.involuntary += delta[i].involuntary;
    counts[key]++;
  }
  const double k = 1000.0 / double(std::max<int64_t>(1, tokens));
  auto line = [&](const std::string& what, double cpu, int64_t vol, int64_t invol) {
    fmt::print(
        "  {:<34} {:8.1f} ms CPU / 1k tokens   {:6.2f} voluntary + {:5.2f} involuntary "
        "switches / token\n",
        what, 1e3 * cpu * k, double(vol) * k / 1000, double(invol) * k / 1000);
  };
  fmt::print("CPU during the served run:\n");
  for (const auto& [key, g] : groups) {
    line(fmt::format("server {} ({} threads)", key, counts[key]), g.cpu_s, g.voluntary,
         g.involuntary);
  }
  auto secs = [](const timeval& t) { return double(t.tv_sec) + 1e-6 * double(t.tv_usec); };
  const double client = secs(b.client.ru_utime) + secs(b.client.ru_stime) -
                        secs(a.client.ru_utime) - secs(a.client.ru_stime);
  line("client (bench process)", client, b.client.ru_nvcsw - a.client.ru_nvcsw,
       b.client.ru_nivcsw - a.client.ru_nivcsw);
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

// The same load from one thread that serves every connection with epoll: a light client,
// as a real one on another machine would cost this one nothing.
Report run_server_load_epoll(const Options& o, int port) {
  struct Conn {
    int client = 0, request = 0, fd = -1;
    StreamParse p;
  };
  Report r;
  int incomplete = 0;
  const int ep = epoll_create1(EPOLL_CLOEXEC);
  std::vector<Conn> conns(size_t(o.clients));
  auto open = [&](Conn& c) {
    c.p = StreamParse{};
    c.fd = connect_to(port);
    c.p.sent = Clock::now();
    if (c.fd < 0 || !send_all(c.fd, request_text(prompt_for(c.client, c.request, o.prompt_tokens),
                                                 o.output_tokens, o.greedy))) {
      fmt::print(stderr, "cannot send a request to the server\n");
      std::exit(2);
    }
    epoll_event ev{};
    ev.events = EPOLLIN;
    ev.data.ptr = &c;
    epoll_ctl(ep, EPOLL_CTL_ADD, c.fd, &ev);
  };
  const auto t0 = Clock::now();
  for (int c = 0; c < o.clients; ++c) {
    conns[size_t(c)].client = c;
    open(conns[size_t(c)]);
  }
  int active = o.clients;
  char buf[16384];
  epoll_event events[64];
  while (active > 0) {
    const int n = epoll_wait(ep, events, 64, 60000);
    if (n <= 0) {
      fmt::print(stderr, "no answer from the server for 60 s\n");
      std::exit(2);
    }
    const auto now = Clock::now();
    for (int i = 0; i < n; ++i) {
      Conn& c = *static_cast<Conn*>(events[i].data.ptr);
      bool closed = false;
      for (;;) {
        const ssize_t got = recv(c.fd, buf, sizeof(buf), MSG_DONTWAIT);
        if (got > 0) {
          c.p.feed(buf, size_t(got), now);
          if (c.p.done) break;
          continue;
        }
        closed = got == 0 || (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR);
        break;
      }
      if (!c.p.done && !closed) continue;
      epoll_ctl(ep, EPOLL_CTL_DEL, c.fd, nullptr);
      close(c.fd);
      const Sample s = c.p.result();
      if (!s.complete || s.tokens != o.output_tokens) ++incomplete;
      r.requests++;
      r.tokens += s.tokens;
      r.ttft.push_back(s.ttft);
      r.tpot.push_back(s.tpot);
      if (++c.request < o.requests) {
        open(c);
      } else {
        --active;
      }
    }
  }
  r.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  close(ep);
  if (incomplete) fmt::print("WARNING: {} requests did not complete in full\n", incomplete);
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
      "live buffers {:.0f} (idle {:.0f}), live bytes {:.0f}, in-flight HTTP {:.0f}, open "
      "connections {:.0f}\n",
      series("recur_state_slots_used"), series("recur_kv_cache_blocks_used"),
      series("recur_num_requests_running"), series("recur_num_requests_waiting"),
      series("recur_live_buffers"), idle_buffers, series("recur_live_bytes"),
      series("recur_http_requests_in_flight"), series("recur_http_connections"));
  // The one open connection is the /metrics request's own.
  const bool idle_ok =
      series("recur_state_slots_used") == 0 && series("recur_kv_cache_blocks_used") == 0 &&
      series("recur_num_requests_running") == 0 && series("recur_num_requests_waiting") == 0 &&
      series("recur_live_buffers") == idle_buffers && series("recur_http_connections") <= 1;
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
  CLI::App app{
      "Load benchmark of `recur serve`: --clients concurrent streaming clients, each sending\n"
      "--requests requests of --prompt-tokens prompt tokens and --output-tokens output tokens in\n"
      "turn, over plain sockets from one epoll thread (a light client, so a small machine\n"
      "measures the server; --client threads: a thread per connection). Then the same work\n"
      "through an in-process Engine with the same configuration, in the same run, and the ratio\n"
      "of output tokens per second, over --rounds alternating rounds; and where the CPU went\n"
      "during the served run (the server's compute threads, its other threads, the client).\n"
      "Soak mode (--soak SECONDS, as bench/bench_serve_soak.sh runs it): clients stream random\n"
      "lengths and cancel at random for that long, then /metrics must be back to its idle\n"
      "values with no request lost, or it exits 1."};
  // Given twice, the last value wins: bench_serve_soak.sh passes its defaults before the caller's.
  app.option_defaults()->always_capture_default()->multi_option_policy(
      CLI::MultiOptionPolicy::TakeLast);
  app.add_option("--recur", o.recur, "the recur program to start the server with");
  app.add_option("--model", o.model, "model directory");
  CLI::Option* clients = app.add_option("--clients", o.clients, "concurrent clients")
                             ->check(CLI::Range(1, 4096))
                             ->default_str("32; 64 with --soak");
  app.add_option("--requests", o.requests, "requests each client sends in turn")
      ->check(CLI::Range(1, 1 << 20));
  app.add_option("--prompt-tokens", o.prompt_tokens,
                 "prompt tokens of each request (with --soak: 8 plus up to this many)")
      ->check(CLI::Range(1, 1 << 24));
  app.add_option("--output-tokens", o.output_tokens,
                 "output tokens of each request (with --soak: 1 to this many)")
      ->check(CLI::Range(1, 1 << 24));
  app.add_option("--max-batch", o.max_batch, "the server's and the engine's --max-batch")
      ->check(CLI::Range(1, 4096))
      ->default_str("32; at least 64 with --soak");
  app.add_option("--threads", o.threads, "CPU threads of the server and the engine (0: all cores)")
      ->check(CLI::Range(0, 1024));
  app.add_flag("--greedy", o.greedy, "greedy sampling instead of the model's defaults");
  app.add_option("--rounds", o.rounds, "rounds of served and in-process runs, alternating")
      ->check(CLI::Range(1, 1000));
  app.add_option("--client", o.client,
                 "epoll: one thread serves every connection; threads: a thread per connection")
      ->check(CLI::IsMember({"epoll", "threads"}));
  app.add_option("--soak", o.soak_seconds, "soak for this many seconds instead (0: off)")
      ->check(CLI::Range(0.0, 1e7));
  app.add_option("--cancel-prob", o.cancel_prob,
                 "with --soak: the probability that a request is cancelled mid-stream")
      ->check(CLI::Range(0.0, 1.0));
  CLI11_PARSE(app, argc, argv);
  if (o.soak_seconds > 0 && clients->count() == 0) o.clients = 64;
  if (o.soak_seconds > 0) o.max_batch = std::max(o.max_batch, 64);
  signal(SIGPIPE, SIG_IGN);
  fmt::print(
      "model {}\nclients {}, {} requests each, prompt {} tokens, output {} tokens, "
      "max batch {}, threads {}, {} sampling, client: {}\n",
      o.model, o.clients, o.requests, o.prompt_tokens, o.output_tokens, o.max_batch,
      o.threads > 0 ? o.threads : default_thread_count(), o.greedy ? "greedy" : "default",
      o.client == "threads" || o.soak_seconds > 0 ? "a thread per connection" : "one epoll thread");
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
  const int compute_threads = o.threads > 0 ? o.threads : default_thread_count();
  for (int r = 0; r < o.rounds; ++r) {
    std::string load = read_text("/proc/loadavg");
    load = load.substr(0, load.find(' ', load.find(' ', load.find(' ') + 1) + 1));
    const ProcessTimes before = process_times(server.pid);
    served.push_back(o.client == "threads" ? run_server_load(o, server.port)
                                           : run_server_load_epoll(o, server.port));
    const ProcessTimes after = process_times(server.pid);
    alone.push_back(run_engine_alone(o));
    const double ratio = (double(served.back().tokens) / served.back().seconds) /
                         (double(alone.back().tokens) / alone.back().seconds);
    ratios.push_back(ratio);
    fmt::print("round {} (load average before it: {}):\n", r + 1, load);
    print("recur serve", served.back());
    print("engine alone", alone.back());
    fmt::print("ratio {:.3f}\n", ratio);
    print_cpu(before, after, served.back().tokens, compute_threads);
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
  // Alternating rounds see the machine's other load alike only on average: all rounds
  // together, each side's tokens over its seconds.
  auto total = [](const std::vector<Report>& v) {
    double tokens = 0, seconds = 0;
    for (const Report& r : v) tokens += double(r.tokens), seconds += r.seconds;
    return tokens / seconds;
  };
  fmt::print(
      "all rounds together: recur serve {:.1f} output tok/s, engine alone {:.1f}, ratio {:.3f}\n",
      total(served), total(alone), total(served) / total(alone));
  fmt::print("server exit status after SIGTERM: {}\n", exit_code);
  return exit_code == 0 ? 0 : 1;
}
