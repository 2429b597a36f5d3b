// HTTP/1.1 messages as the server reads and writes them (RFC 9112), strictly: a request head
// that is ambiguous or malformed (two Content-Length headers, a header line without a colon or
// with a NUL, obsolete line folding, a Content-Length that is not a plain number) is refused
// with a status and a message naming what is wrong, before any body is read. Pure functions and
// a resumable chunked decoder, so every rule is unit-testable without a socket.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

namespace recur::server::http {

struct Header {
  std::string name;  // lowercase
  std::string value;
};

struct Limits {
  size_t max_line = 8192;      // request line or one header line, bytes
  size_t max_head = 65536;     // request line plus all header lines
  size_t max_headers = 100;    // header lines
  size_t max_body = 8 << 20;   // decoded body, whatever the transfer encoding
  size_t max_chunk_ext = 256;  // chunk extensions of one chunk (ignored, but bounded)
};

struct Request {
  std::string method;
  std::string target;  // as sent
  std::string path;    // target without the query, origin-form
  std::string query;
  int minor_version = 1;  // HTTP/1.<minor>
  std::vector<Header> headers;
  std::string body;
  // Framing, from the headers.
  bool chunked = false;
  std::optional<uint64_t> content_length;
  bool keep_alive = true;
  bool expect_continue = false;

  // The value of the first header of that (lowercase) name, or nullptr.
  const std::string* header(std::string_view lower_name) const;
  bool has_body() const { return chunked || content_length.value_or(0) > 0; }
};

struct ParseError {
  int status = 400;
  std::string message;
};

// Where the head that starts at buf[0] ends (just past its empty line), or nullopt while more
// bytes are needed. *scanned carries the resume point between calls on a growing buffer. An
// over-long line or head is an error at once, without waiting for its end.
std::variant<std::optional<size_t>, ParseError> find_head_end(std::string_view buf, size_t* scanned,
                                                              const Limits& limits);

// Parses a complete head (request line, header lines, empty line; CRLF or bare LF).
std::variant<Request, ParseError> parse_head(std::string_view head, const Limits& limits);

// Decodes a chunked body as it arrives; the decoded size is checked against the limit before
// the data of a chunk is read, so an oversized body fails at its first oversized chunk header.
class ChunkedDecoder {
 public:
  enum class Status { kNeedMore, kDone, kError };
  // Consumes from `data` (*consumed: how many bytes, possibly fewer than given once done) and
  // appends the decoded bytes to *body.
  Status feed(std::string_view data, size_t* consumed, std::string* body, const Limits& limits);
  const ParseError& error() const { return error_; }

 private:
  Status fail(int status, std::string message);
  enum class State { kSize, kSizeSpace, kExt, kSizeLf, kData, kDataCr, kDataLf, kTrailer, kDone };
  State state_ = State::kSize;
  uint64_t size_ = 0;  // of the current chunk, then what is left of it
  int digits_ = 0;
  size_t ext_ = 0;           // chunk-extension bytes of this chunk
  size_t trailer_line_ = 0;  // bytes of the current trailer line
  size_t trailer_bytes_ = 0;
  ParseError error_;
};

struct Response {
  int status = 200;
  std::string content_type = "application/json";
  std::vector<Header> headers;  // besides Content-Type, Content-Length and Connection
  std::string body;

  void set_header(std::string name, std::string value);
};

const char* reason_phrase(int status);

// Status line and headers, ending in the empty line. content_length nullopt: a chunked body, or
// with chunked false (HTTP/1.0 knows no chunking) a body that the close ends.
std::string serialize_head(const Response& res, bool keep_alive,
                           std::optional<size_t> content_length, bool chunked = true);

// Percent-decoding of a path segment; nullopt when an escape is malformed.
std::optional<std::string> percent_decode(std::string_view s);

}  // namespace recur::server::http
