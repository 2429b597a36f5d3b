// The stream writer over a real engine (the tiny real-vocabulary model) and a socket pair:
// what it writes is well-formed HTTP chunking around SSE, at most one chunk per stream per
// engine step, and the tokens are exactly those of the same requests run without streaming;
// a client that stops reading gets everything once it reads again; a closed socket cancels
// the sequence; a stream without a known socket is relayed to its HTTP thread unchanged.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <thread>

#include "backend/cpu/cpu_ops.h"
#include "server/format.h"
#include "server/stream_writer.h"

namespace recur::server {
namespace {

const std::string kModel = std::string(RECUR_SOURCE_DIR) + "/models/qwen3next-tiny-realvocab";
// Short, so a stalled client is dropped within the test; long beside the slow reader's pause.
constexpr std::chrono::milliseconds kStallLimit{1500};

class StreamWriterTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto tok = Tokenizer::load(kModel);
    ASSERT_TRUE(tok.ok()) << tok.error().to_string();
    tokenizer_ = std::make_unique<Tokenizer>(std::move(*tok));
    ops_ = std::make_unique<CpuOps>(1);
    EngineConfig cfg;
    cfg.max_batch = 8;
    cfg.max_batch_tokens = 256;
    cfg.kv_cache_bytes = int64_t(64) << 20;
    auto e = Engine::create(kModel, *ops_, cfg, tokenizer_.get());
    ASSERT_TRUE(e.ok()) << e.error().to_string();
    engine_ = std::move(*e);
    const ModelInfo& info = engine_->model_info();
    ctx_.model_name = std::filesystem::path(kModel).filename().string();
    ctx_.vocab_size = info.vocab_size;
    ctx_.max_context = engine_->config().max_context;
    ctx_.generation = info.generation;
    ctx_.eos_token_ids = info.eos_token_ids;
    ctx_.tokenizer = tokenizer_.get();
    metrics_ = std::make_shared<Metrics>();
    auto w = StreamWriter::create(metrics_, kStallLimit);
    ASSERT_TRUE(w.ok());
    writer_ = std::move(*w);
    engine_->set_step_listener([this] {
      ++steps_with_events_;
      writer_->step_done();
    });
    engine_->start();
  }

  void TearDown() override {
    if (engine_) engine_->set_step_listener({});
    writer_.reset();
    engine_.reset();
  }

  std::shared_ptr<Generation> start(const std::string& body) {
    auto parsed = parse_completion_request(ojson::parse(body), ctx_);
    EXPECT_TRUE(parsed.ok()) << parsed.error().message;
    auto gen =
        std::make_shared<Generation>(*engine_, ctx_, std::move(*parsed), metrics_, Clock::now());
    auto st = gen->start();
    EXPECT_TRUE(st.ok());
    return gen;
  }

  // Token ids of each choice of a non-streaming run of the same request.
  std::vector<std::vector<int32_t>> solo_ids(const std::string& body) {
    auto gen = start(body);
    std::vector<ChoiceUpdate> updates;
    while (!gen->done()) {
      gen->wait(-1, 1000);
      gen->drain(&updates);
    }
    std::vector<std::vector<int32_t>> ids;
    for (const auto& c : gen->choices()) ids.push_back(c.ids);
    return ids;
  }

  std::unique_ptr<Tokenizer> tokenizer_;
  std::unique_ptr<CpuOps> ops_;
  std::unique_ptr<Engine> engine_;
  ServingContext ctx_;
  std::shared_ptr<Metrics> metrics_;
  std::unique_ptr<StreamWriter> writer_;
  std::atomic<int> steps_with_events_{0};
};

// Reads the socket to its end: the body's chunks, parsed strictly as HTTP/1.1 chunked framing
// (without the final 0-size chunk, which is the HTTP layer's to write).
struct Received {
  std::vector<std::string> chunks;
  std::string sse;  // the chunks joined
};

Received read_chunks(int fd, bool* framing_ok) {
  std::string raw;
  char buf[4096];
  for (ssize_t n; (n = read(fd, buf, sizeof(buf))) > 0;) raw.append(buf, size_t(n));
  Received r;
  *framing_ok = true;
  size_t at = 0;
  while (at < raw.size()) {
    const size_t eol = raw.find("\r\n", at);
    if (eol == std::string::npos) {
      *framing_ok = false;
      break;
    }
    size_t used = 0;
    const unsigned long len = std::stoul(raw.substr(at, eol - at), &used, 16);
    if (used != eol - at || len == 0 || eol + 2 + len + 2 > raw.size() ||
        raw.compare(eol + 2 + len, 2, "\r\n") != 0) {
      *framing_ok = false;
      break;
    }
    r.chunks.push_back(raw.substr(eol + 2, len));
    r.sse += r.chunks.back();
    at = eol + 2 + len + 2;
  }
  return r;
}

// Token ids per choice index from the SSE events, and whether the stream ends with [DONE].
std::vector<std::vector<int32_t>> streamed_ids(const std::string& sse, size_t choices, bool* done) {
  std::vector<std::vector<int32_t>> ids(choices);
  *done = false;
  size_t at = 0;
  for (size_t end; (end = sse.find("\n\n", at)) != std::string::npos; at = end + 2) {
    const std::string ev = sse.substr(at, end - at);
    EXPECT_EQ(ev.rfind("data: ", 0), 0u) << ev;
    const std::string data = ev.substr(6);
    EXPECT_FALSE(*done) << "an event after [DONE]";
    if (data == "[DONE]") {
      *done = true;
      continue;
    }
    const ojson j = ojson::parse(data);
    for (const auto& c : j["choices"]) {
      for (const auto& t : c["token_ids"])
        ids[c["index"].get<size_t>()].push_back(t.get<int32_t>());
    }
  }
  EXPECT_EQ(at, sse.size()) << "a partial event at the end";
  return ids;
}

TEST_F(StreamWriterTest, ChunksPerStepAndTokensEqualNonStreaming) {
  const std::vector<std::string> bodies = {
      R"({"prompt":[11,22,33,44,55],"max_tokens":20,"temperature":0,"ignore_eos":true,"return_token_ids":true})",
      R"({"prompt":"The quick brown fox","max_tokens":17,"temperature":0,"ignore_eos":true,"return_token_ids":true,"n":2})",
      R"({"prompt":[7,8,9],"max_tokens":9,"temperature":0,"ignore_eos":true,"return_token_ids":true})",
  };
  std::vector<std::vector<std::vector<int32_t>>> solo;
  for (const auto& b : bodies) solo.push_back(solo_ids(b));

  struct Client {
    int fds[2];
    std::shared_ptr<Generation> gen;
    std::shared_ptr<SseStream> stream;
  };
  std::vector<Client> clients(bodies.size());
  const int steps_before = steps_with_events_.load();
  for (size_t i = 0; i < bodies.size(); ++i) {
    ASSERT_EQ(socketpair(AF_UNIX, SOCK_STREAM, 0, clients[i].fds), 0);
    ojson b = ojson::parse(bodies[i]);
    b["stream"] = true;
    clients[i].gen = start(b.dump());
    clients[i].stream = writer_->add(clients[i].gen, clients[i].fds[0]);
  }
  for (size_t i = 0; i < bodies.size(); ++i) {
    Client& c = clients[i];
    std::string unused;
    ASSERT_EQ(c.stream->next(&unused), SseStream::Next::kDone);
    shutdown(c.fds[0], SHUT_WR);
    bool framing_ok = false;
    const Received r = read_chunks(c.fds[1], &framing_ok);
    EXPECT_TRUE(framing_ok);
    bool done = false;
    const auto ids = streamed_ids(r.sse, solo[i].size(), &done);
    EXPECT_TRUE(done);
    EXPECT_EQ(ids, solo[i]) << "stream " << i;
    // Coalesced: one chunk per engine step that had events at most, although every choice
    // produced a token in most of them.
    // (+1 per stream: a stream's registration also wakes the writer.)
    const int steps = steps_with_events_.load() - steps_before;
    EXPECT_LE(int(r.chunks.size()), steps + int(bodies.size())) << "stream " << i;
    size_t tokens = 0;
    for (const auto& v : ids) tokens += v.size();
    if (solo[i].size() > 1) {
      EXPECT_LT(r.chunks.size(), tokens) << "choices not coalesced";
    }
    close(c.fds[0]);
    close(c.fds[1]);
  }
}

// Drains reuse their updates' buffers (recycle): each pass must still report only that pass's
// news: the texts and tokens of all passes add up to each choice's whole output, once.
TEST_F(StreamWriterTest, RecycledUpdatesCarryOnlyEachPassesNews) {
  auto gen =
      start(R"({"prompt":"The quick brown fox","max_tokens":40,"temperature":0,"ignore_eos":true,)"
            R"("logprobs":2,"n":2,"stream":true})");
  std::vector<ChoiceUpdate> updates;
  std::vector<std::string> text(2);
  std::vector<int> tokens(2, 0), finished(2, 0);
  int passes = 0;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (!gen->done() && std::chrono::steady_clock::now() < deadline) {
    if (!gen->has_events()) {  // poll: drain a few steps' news at a time, as the writer does
      std::this_thread::sleep_for(std::chrono::microseconds(200));
      continue;
    }
    gen->recycle(&updates);
    ASSERT_TRUE(updates.empty());
    gen->drain(&updates);
    ++passes;
    for (const ChoiceUpdate& u : updates) {
      ASSERT_TRUE(u.index == 0 || u.index == 1);
      text[size_t(u.index)] += u.text;
      tokens[size_t(u.index)] += int(u.tokens.size());
      finished[size_t(u.index)] += u.finished ? 1 : 0;
    }
  }
  EXPECT_GT(passes, 2);
  for (size_t i = 0; i < 2; ++i) {
    EXPECT_EQ(text[i], gen->choices()[i].text) << "choice " << i;
    EXPECT_EQ(tokens[i], 40) << "choice " << i;
    EXPECT_EQ(tokens[i], gen->choices()[i].generated) << "choice " << i;
    EXPECT_EQ(finished[i], 1) << "choice " << i;
  }
}

TEST_F(StreamWriterTest, SlowReaderGetsEverythingOnceItReads) {
  const std::string body =
      R"({"prompt":[5,6,7],"max_tokens":300,"temperature":0,"ignore_eos":true,"return_token_ids":true,"logprobs":5})";
  const auto solo = solo_ids(body);
  int fds[2];
  ASSERT_EQ(socketpair(AF_UNIX, SOCK_STREAM, 0, fds), 0);
  const int small = 4096;  // the writer fills this long before the stream ends
  setsockopt(fds[0], SOL_SOCKET, SO_SNDBUF, &small, sizeof(small));
  setsockopt(fds[1], SOL_SOCKET, SO_RCVBUF, &small, sizeof(small));
  ojson b = ojson::parse(body);
  b["stream"] = true;
  auto gen = start(b.dump());
  auto stream = writer_->add(gen, fds[0]);
  std::this_thread::sleep_for(std::chrono::milliseconds(300));  // nobody reads meanwhile
  std::thread reader([&] {
    bool framing_ok = false;
    const Received r = read_chunks(fds[1], &framing_ok);
    EXPECT_TRUE(framing_ok);
    bool done = false;
    EXPECT_EQ(streamed_ids(r.sse, 1, &done), solo);
    EXPECT_TRUE(done);
  });
  std::string unused;
  EXPECT_EQ(stream->next(&unused), SseStream::Next::kDone);
  shutdown(fds[0], SHUT_WR);
  reader.join();
  close(fds[0]);
  close(fds[1]);
}

TEST_F(StreamWriterTest, ClosedSocketCancelsTheSequence) {
  int fds[2];
  ASSERT_EQ(socketpair(AF_UNIX, SOCK_STREAM, 0, fds), 0);
  auto gen = start(R"({"prompt":[1,2,3],"max_tokens":100000,"ignore_eos":true,"stream":true})");
  auto stream = writer_->add(gen, fds[0]);
  char buf[256];
  ASSERT_GT(read(fds[1], buf, sizeof(buf)), 0);  // it is streaming
  close(fds[1]);                                 // the client goes away
  std::string unused;
  EXPECT_EQ(stream->next(&unused), SseStream::Next::kGone);
  const auto t0 = std::chrono::steady_clock::now();
  while (engine_->stats().slots_used != 0) {
    ASSERT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(5));
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  EXPECT_EQ(engine_->stats().kv_blocks_used, 0);
  close(fds[0]);
}

TEST_F(StreamWriterTest, StalledReaderIsDroppedAsAWriteTimeout) {
  int fds[2];
  ASSERT_EQ(socketpair(AF_UNIX, SOCK_STREAM, 0, fds), 0);
  const int small = 4096;  // full after a few steps; the client never reads
  setsockopt(fds[0], SOL_SOCKET, SO_SNDBUF, &small, sizeof(small));
  setsockopt(fds[1], SOL_SOCKET, SO_RCVBUF, &small, sizeof(small));
  auto gen = start(
      R"({"prompt":[1,2,3],"max_tokens":100000,"ignore_eos":true,"stream":true,"logprobs":5})");
  const auto t0 = std::chrono::steady_clock::now();
  auto stream = writer_->add(gen, fds[0]);
  std::string unused;
  EXPECT_EQ(stream->next(&unused), SseStream::Next::kGone);
  EXPECT_GE(std::chrono::steady_clock::now() - t0, kStallLimit);
  while (engine_->stats().slots_used != 0) {
    ASSERT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(20));
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  const std::string text = metrics_->render(engine_->stats());
  EXPECT_NE(text.find("recur_http_connections_closed_total{reason=\"write_timeout\"} 1\n"),
            std::string::npos);
  EXPECT_NE(text.find("recur_client_disconnects_total 0\n"), std::string::npos);
  close(fds[0]);
  close(fds[1]);
}

TEST_F(StreamWriterTest, UnknownSocketIsRelayedUnframed) {
  const std::string body =
      R"({"prompt":[3,1,4,1,5],"max_tokens":12,"temperature":0,"ignore_eos":true,"return_token_ids":true})";
  const auto solo = solo_ids(body);
  ojson b = ojson::parse(body);
  b["stream"] = true;
  auto stream = writer_->add(start(b.dump()), -1);
  std::string sse, data;
  SseStream::Next next;
  while ((next = stream->next(&data)) == SseStream::Next::kData) sse += data;
  EXPECT_EQ(next, SseStream::Next::kDone);
  bool done = false;
  EXPECT_EQ(streamed_ids(sse, 1, &done), solo);
  EXPECT_TRUE(done);
}

}  // namespace
}  // namespace recur::server
