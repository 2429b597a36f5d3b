// HTTP request heads and chunked bodies as the server reads them off a socket, in pieces of a
// size the input picks: the resumable scans must give what one pass over the whole gives.
#include <optional>
#include <string>
#include <string_view>
#include <variant>

#include "fuzz_targets.h"
#include "server/http_message.h"

namespace recur::fuzz {

namespace http = server::http;

namespace {

// Small limits, so that inputs of a few hundred bytes reach every limit.
http::Limits small_limits() {
  http::Limits l;
  l.max_line = 64;
  l.max_head = 256;
  l.max_headers = 6;
  l.max_body = 300;
  l.max_chunk_ext = 12;
  return l;
}

void check_error(const http::ParseError& e) {
  FUZZ_CHECK(e.status >= 400 && e.status < 600);
  FUZZ_CHECK(!e.message.empty());
}

struct Decoded {
  http::ChunkedDecoder::Status status;
  std::string body;
  size_t consumed = 0;
};

Decoded decode_chunked(std::string_view data, size_t piece, const http::Limits& limits) {
  http::ChunkedDecoder dec;
  Decoded d{http::ChunkedDecoder::Status::kNeedMore, {}, 0};
  while (d.status == http::ChunkedDecoder::Status::kNeedMore && d.consumed < data.size()) {
    const std::string_view part = data.substr(d.consumed, piece);
    size_t used = 0;
    d.status = dec.feed(part, &used, &d.body, limits);
    FUZZ_CHECK(used <= part.size());
    // Short of the end, a decoder that needs more has taken everything it was given.
    if (d.status == http::ChunkedDecoder::Status::kNeedMore) FUZZ_CHECK(used == part.size());
    d.consumed += used;
    FUZZ_CHECK(d.body.size() <= limits.max_body);
  }
  if (d.status == http::ChunkedDecoder::Status::kError) check_error(dec.error());
  return d;
}

}  // namespace

int fuzz_http(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const size_t piece = 1 + data[0] % 64;
  const std::string_view stream(reinterpret_cast<const char*>(data + 1), size - 1);
  const http::Limits limits = small_limits();

  // The head, scanned as bytes arrive.
  size_t scanned = 0;
  std::optional<size_t> head_end;
  size_t have = 0;
  bool failed = false;
  while (!head_end && !failed && have < stream.size()) {
    have = std::min(stream.size(), have + piece);
    auto r = http::find_head_end(stream.substr(0, have), &scanned, limits);
    if (auto* e = std::get_if<http::ParseError>(&r)) {
      check_error(*e);
      failed = true;
    } else {
      head_end = std::get<std::optional<size_t>>(r);
    }
  }
  // The same bytes in one call: the same end, or the same refusal.
  size_t fresh = 0;
  auto once = http::find_head_end(stream.substr(0, have), &fresh, limits);
  FUZZ_CHECK(std::holds_alternative<http::ParseError>(once) == failed);
  if (!failed) FUZZ_CHECK(std::get<std::optional<size_t>>(once) == head_end);
  if (!head_end) return 0;
  FUZZ_CHECK(*head_end <= have && *head_end <= limits.max_head + 2);

  auto parsed = http::parse_head(stream.substr(0, *head_end), limits);
  if (auto* e = std::get_if<http::ParseError>(&parsed)) {
    check_error(*e);
    return 0;
  }
  const http::Request& req = std::get<http::Request>(parsed);
  FUZZ_CHECK(req.headers.size() <= limits.max_headers);
  FUZZ_CHECK(!(req.chunked && req.content_length));
  (void)http::percent_decode(req.path);
  (void)http::serialize_head(http::Response{}, req.keep_alive, std::nullopt, req.minor_version > 0);

  if (!req.chunked) return 0;
  const std::string_view body = stream.substr(*head_end);
  const Decoded split = decode_chunked(body, piece, limits);
  const Decoded whole = decode_chunked(body, body.size() + 1, limits);
  FUZZ_CHECK(split.status == whole.status);
  if (split.status != http::ChunkedDecoder::Status::kError) {
    FUZZ_CHECK(split.body == whole.body);
    FUZZ_CHECK(split.consumed == whole.consumed);
  }
  return 0;
}

}  // namespace recur::fuzz
