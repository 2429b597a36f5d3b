// One thread writes every streaming response. The engine's step listener wakes it once per
// step; it turns each stream's new events into one SSE chunk and sends it without blocking, and
// it watches every client socket for a hang-up. The HTTP thread that owns a connection only
// waits for its stream to end, so a generated token costs no thread wake-up of its own.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "core/status.h"
#include "server/generation.h"
#include "server/metrics.h"

namespace recur::server {

class StreamWriter;

// A streaming response as its HTTP thread sees it.
class SseStream {
 public:
  enum class Next { kData, kDone, kGone };
  // Blocks until there is something for the HTTP thread: kDone once every byte of the stream
  // is on the socket (the caller then ends the chunked response), kGone when the client went
  // away or the server is stopping, kData (relayed streams only) with bytes for it to write.
  Next next(std::string* data);
  // Relayed streams: the HTTP thread could not write, so the client is gone.
  void client_gone();

 private:
  friend class StreamWriter;
  std::mutex mu_;
  std::condition_variable cv_;
  std::string relay_;  // bytes the HTTP thread writes itself (no socket known)
  bool ended_ = false, complete_ = false;
  std::atomic<bool> relay_failed_{false};
};

class StreamWriter {
 public:
  // A client that reads nothing for stall_limit (the HTTP layer's write timeout) is dropped.
  static Result<std::unique_ptr<StreamWriter>> create(std::shared_ptr<Metrics> metrics,
                                                      std::chrono::milliseconds stall_limit);
  ~StreamWriter();  // streams still open end as kGone
  StreamWriter(const StreamWriter&) = delete;
  StreamWriter& operator=(const StreamWriter&) = delete;

  // From the engine thread after a step: one wake-up for all streams (none when idle or when
  // the writer has a wake-up pending already).
  void step_done() noexcept;

  // Takes over a started streaming generation whose response headers are already on the
  // socket `fd`: from now on only the writer thread touches `gen`, and it writes the chunks
  // (HTTP chunked framing; unframed with chunked false, for HTTP/1.0) straight to `fd`. With
  // fd < 0 (socket unknown) the chunks are relayed to the HTTP thread through SseStream::next.
  std::shared_ptr<SseStream> add(std::shared_ptr<Generation> gen, int fd, bool chunked = true);

  struct Stream;

 private:
  StreamWriter() = default;
  void run();
  void pass(Stream& s);  // drain, format, send
  void frame(Stream& s, std::string_view text);
  void flush(Stream& s);  // send what is pending, without blocking
  void end(Stream& s, bool complete);
  void gone(Stream& s);     // the client went away: counted as a disconnect, dropped
  void stalled(Stream& s);  // the client stopped reading: counted as a write timeout, dropped
  void drop(Stream& s);     // end, cancel
  void watch(Stream& s, bool want_out);

  std::shared_ptr<Metrics> metrics_;
  std::chrono::milliseconds stall_limit_{0};
  int epoll_fd_ = -1, wake_fd_ = -1;
  std::atomic<bool> wake_pending_{false};
  std::atomic<int> open_streams_{0};
  std::mutex mu_;
  std::vector<std::shared_ptr<Stream>> incoming_;  // guarded by mu_
  bool stop_ = false;                              // guarded by mu_
  std::vector<std::shared_ptr<Stream>> active_;    // writer thread only
  std::thread thread_;
};

}  // namespace recur::server
