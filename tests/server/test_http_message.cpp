// The server's HTTP/1.1 parsing: what a well-formed head gives, the status and message of
// every framing error (ambiguous lengths, malformed lines, limits), and the chunked decoder's
// byte-at-a-time equivalence and its size check before a chunk's data is read.
#include <gtest/gtest.h>

#include "server/http_message.h"

namespace recur::server::http {
namespace {

Request parse_ok(const std::string& head, const Limits& limits = Limits()) {
  auto r = parse_head(head, limits);
  if (auto* e = std::get_if<ParseError>(&r)) {
    ADD_FAILURE() << head << " -> " << e->status << " " << e->message;
    return Request();
  }
  return std::get<Request>(r);
}

ParseError parse_fail(const std::string& head, const Limits& limits = Limits()) {
  auto r = parse_head(head, limits);
  if (!std::holds_alternative<ParseError>(r)) {
    ADD_FAILURE() << "accepted: " << head;
    return ParseError{0, ""};
  }
  return std::get<ParseError>(r);
}

TEST(HttpHead, ParsesRequestLineHeadersAndFraming) {
  Request r = parse_ok(
      "POST /v1/chat/completions?x=1 HTTP/1.1\r\nHost: a\r\nContent-Length: 12\r\n"
      "X-Api-Key:  secret \r\nConnection: keep-alive\r\n\r\n");
  EXPECT_EQ(r.method, "POST");
  EXPECT_EQ(r.path, "/v1/chat/completions");
  EXPECT_EQ(r.query, "x=1");
  EXPECT_EQ(r.minor_version, 1);
  ASSERT_TRUE(r.content_length);
  EXPECT_EQ(*r.content_length, 12u);
  EXPECT_FALSE(r.chunked);
  EXPECT_TRUE(r.keep_alive);
  ASSERT_NE(r.header("x-api-key"), nullptr);
  EXPECT_EQ(*r.header("x-api-key"), "secret");  // names lowercase, values trimmed

  r = parse_ok("POST /a HTTP/1.1\nHost: a\nTransfer-Encoding: Chunked\nConnection: close\n\n");
  EXPECT_TRUE(r.chunked);  // bare LF line ends are accepted (RFC 9112 2.2)
  EXPECT_FALSE(r.keep_alive);
  r = parse_ok("\r\nGET / HTTP/1.0\r\n\r\n");  // a leading empty line is skipped
  EXPECT_FALSE(r.keep_alive);
  r = parse_ok("GET http://host:1/v1/models?a HTTP/1.1\r\nHost: h\r\n\r\n");
  EXPECT_EQ(r.path, "/v1/models");
  r = parse_ok("OPTIONS * HTTP/1.1\r\nHost: h\r\n\r\n");
  EXPECT_EQ(r.path, "*");
  r = parse_ok("POST / HTTP/1.1\r\nHost: h\r\nExpect: 100-Continue\r\nContent-Length: 1\r\n\r\n");
  EXPECT_TRUE(r.expect_continue);
  // An HTTP/1.0 client's expectation is ignored (RFC 9110 10.1.1): no 100 is sent to it.
  r = parse_ok("POST / HTTP/1.0\r\nExpect: 100-continue\r\nContent-Length: 1\r\n\r\n");
  EXPECT_FALSE(r.expect_continue);
}

TEST(HttpHead, AmbiguousOrMalformedFramingIsRefused) {
  struct Case {
    const char* head;
    int status;
    const char* says;
  };
  const Case cases[] = {
      {"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 2\r\nContent-Length: 5\r\n\r\n", 400,
       "more than one Content-Length"},
      {"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 2\r\nContent-Length: 2\r\n\r\n", 400,
       "more than one Content-Length"},
      {"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: -1\r\n\r\n", 400, "invalid Content-Length"},
      {"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: +5\r\n\r\n", 400, "invalid Content-Length"},
      {"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 5 5\r\n\r\n", 400, "invalid Content-Length"},
      {"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 1234567890123456789\r\n\r\n", 400,
       "invalid Content-Length"},
      {"POST / HTTP/1.1\r\nHost: a\r\nContent-Length:\r\n\r\n", 400, "invalid Content-Length"},
      {"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 2\r\nTransfer-Encoding: chunked\r\n\r\n", 400,
       "both Content-Length and Transfer-Encoding"},
      {"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: gzip, chunked\r\n\r\n", 501,
       "only chunked"},
      {"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\nTransfer-Encoding: chunked"
       "\r\n\r\n",
       400, "more than one Transfer-Encoding"},
      {"POST / HTTP/1.0\r\nTransfer-Encoding: chunked\r\n\r\n", 400, "HTTP/1.0"},
      {"GET / HTTP/1.1\r\nHost: a\r\nNoColon\r\n\r\n", 400, "without a colon"},
      {"GET / HTTP/1.1\r\nHost: a\r\nX: a\x07\r\n\r\n", 400, "control character"},
      {"GET / HTTP/1.1\r\nHost: a\r\nX : b\r\n\r\n", 400, "whitespace before the colon"},
      {"GET / HTTP/1.1\r\nHost: a\r\nX: b\r\n c\r\n\r\n", 400, "folding"},
      {"GET / HTTP/1.1\r\nHost: a\r\nX: a\rb\r\n\r\n", 400, "bare CR"},
      {"GET / HTTP/1.1\r\nHost: a\r\n: b\r\n\r\n", 400, "empty name"},
      {"GET / HTTP/1.1\r\nHo(st: a\r\n\r\n", 400, "malformed header name"},
      {"GET / HTTP/1.1\r\n\r\n", 400, "Host"},
      {"GET / HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n", 400, "more than one Host"},
      {"GET  / HTTP/1.1\r\nHost: a\r\n\r\n", 400, "malformed request line"},
      {"GET /\r\n\r\n", 400, "malformed request line"},
      {"G(T / HTTP/1.1\r\nHost: a\r\n\r\n", 400, "malformed method"},
      {"GET /a\x01 HTTP/1.1\r\nHost: a\r\n\r\n", 400, "percent-encoded"},
      {"GET nope HTTP/1.1\r\nHost: a\r\n\r\n", 400, "does not start with '/'"},
      {"GET * HTTP/1.1\r\nHost: a\r\n\r\n", 400, "only for OPTIONS"},
      {"GET / HTTP/2.0\r\nHost: a\r\n\r\n", 505, "HTTP/2.0"},
      {"GET / HTTQ/1.1\r\nHost: a\r\n\r\n", 400, "malformed HTTP version"},
      {"POST / HTTP/1.1\r\nHost: a\r\nExpect: 200-ok\r\n\r\n", 417, "Expect"},
      {"POST / HTTP/1.1\r\nHost: a\r\nContent-Encoding: gzip\r\n\r\n", 415, "uncompressed"},
  };
  for (const Case& c : cases) {
    const ParseError e = parse_fail(c.head);
    EXPECT_EQ(e.status, c.status) << c.head << ": " << e.message;
    EXPECT_NE(e.message.find(c.says), std::string::npos) << c.head << ": " << e.message;
  }
  // A NUL in a header value (not expressible in the table's C strings).
  const std::string nul = std::string("GET / HTTP/1.1\r\nHost: a\r\nX: a") + '\0' + "b\r\n\r\n";
  EXPECT_NE(parse_fail(nul).message.find("NUL"), std::string::npos);
}

TEST(HttpHead, LimitsAreErrorsBeforeTheHeadEnds) {
  Limits limits;
  limits.max_line = 64;
  limits.max_head = 256;
  limits.max_headers = 3;
  size_t scanned = 0;
  // An over-long request line is a 414 as soon as it is longer, without its end.
  std::string line = "GET /" + std::string(100, 'a');
  auto r = find_head_end(line, &scanned, limits);
  ASSERT_TRUE(std::holds_alternative<ParseError>(r));
  EXPECT_EQ(std::get<ParseError>(r).status, 414);
  // An over-long header line: 431.
  scanned = 0;
  std::string head = "GET / HTTP/1.1\r\nX: " + std::string(100, 'b');
  r = find_head_end(head, &scanned, limits);
  ASSERT_TRUE(std::holds_alternative<ParseError>(r));
  EXPECT_EQ(std::get<ParseError>(r).status, 431);
  // Too many header lines: 431; a head past max_head: 431.
  EXPECT_EQ(parse_fail("GET / HTTP/1.1\r\nHost: a\r\nA: 1\r\nB: 2\r\nC: 3\r\n\r\n", limits).status,
            431);
  scanned = 0;
  std::string many = "GET / HTTP/1.1\r\n";
  for (int i = 0; i < 10; ++i)
    many += "Header-" + std::to_string(i) + ": " + std::string(40, 'c') + "\r\n";
  r = find_head_end(many, &scanned, limits);
  ASSERT_TRUE(std::holds_alternative<ParseError>(r));
  EXPECT_EQ(std::get<ParseError>(r).status, 431);
}

TEST(HttpHead, FindsTheEndAcrossPartialReads) {
  const std::string full = "\r\nGET / HTTP/1.1\r\nHost: a\r\n\r\nBODY";
  std::string buf;
  size_t scanned = 0;
  std::optional<size_t> end;
  for (char c : full) {
    buf += c;
    auto r = find_head_end(buf, &scanned, Limits());
    ASSERT_FALSE(std::holds_alternative<ParseError>(r));
    end = std::get<std::optional<size_t>>(r);
    if (end) break;
  }
  ASSERT_TRUE(end);
  EXPECT_EQ(*end, full.size() - 4);
  EXPECT_EQ(parse_ok(buf.substr(0, *end)).path, "/");
}

// Feeds `data` in pieces of `step` bytes; the decoded body, or the error.
std::variant<std::string, ParseError> decode(const std::string& data, size_t step,
                                             const Limits& limits = Limits(),
                                             size_t* left_over = nullptr) {
  ChunkedDecoder d;
  std::string body;
  size_t pos = 0;
  while (pos < data.size()) {
    const std::string_view piece = std::string_view(data).substr(pos, step);
    size_t used = 0;
    const auto st = d.feed(piece, &used, &body, limits);
    pos += used;
    if (st == ChunkedDecoder::Status::kError) return d.error();
    if (st == ChunkedDecoder::Status::kDone) {
      if (left_over) *left_over = data.size() - pos;
      return body;
    }
    EXPECT_EQ(used, piece.size());
  }
  return ParseError{0, "incomplete"};
}

TEST(HttpChunked, DecodesWholeOrByteByByte) {
  const std::string data =
      "5\r\nhello\r\n1;name=value\r\n \r\nA\r\n0123456789\r\n0\r\nTrailer: x\r\n\r\nNEXT";
  for (size_t step : {size_t(1), size_t(2), size_t(7), data.size()}) {
    size_t left = 0;
    auto r = decode(data, step, Limits(), &left);
    ASSERT_TRUE(std::holds_alternative<std::string>(r)) << std::get<ParseError>(r).message;
    EXPECT_EQ(std::get<std::string>(r), "hello 0123456789");
    EXPECT_EQ(left, 4u) << "the next request's bytes are left alone";
  }
  auto lf = decode("3\nabc\n0\n\n", 1);  // bare LF line ends
  ASSERT_TRUE(std::holds_alternative<std::string>(lf));
  EXPECT_EQ(std::get<std::string>(lf), "abc");
}

TEST(HttpChunked, BadFramingAndTheSizeLimit) {
  struct Case {
    const char* data;
    int status;
  };
  for (const Case& c :
       {Case{"ZZ\r\nabc\r\n0\r\n\r\n", 400}, Case{"\r\n", 400}, Case{"2\r\nabc\r\n0\r\n\r\n", 400},
        Case{"2\r\nab\rX", 400}, Case{"1234567890abcdef0\r\n", 400}, Case{"5 x\r\n", 400}}) {
    auto r = decode(c.data, 1);
    ASSERT_TRUE(std::holds_alternative<ParseError>(r)) << c.data;
    EXPECT_EQ(std::get<ParseError>(r).status, c.status) << c.data;
  }
  // The limit is checked at the chunk header: a 2 GiB chunk fails before any of its data.
  Limits limits;
  limits.max_body = 10;
  auto r = decode("80000000\r\n", 1, limits);
  ASSERT_TRUE(std::holds_alternative<ParseError>(r));
  EXPECT_EQ(std::get<ParseError>(r).status, 413);
  // Many small chunks add up past it too.
  r = decode("6\r\nabcdef\r\n6\r\nghijkl\r\n0\r\n\r\n", 3, limits);
  ASSERT_TRUE(std::holds_alternative<ParseError>(r));
  EXPECT_EQ(std::get<ParseError>(r).status, 413);
  r = decode("5\r\nabcde\r\n5\r\nfghij\r\n0\r\n\r\n", 3, limits);
  ASSERT_TRUE(std::holds_alternative<std::string>(r));  // exactly the limit is fine
}

// Every byte of a trailer counts toward its bound, the CRs of its line ends too: an endless run
// of CRs after the last chunk is an error, not a body that never ends.
TEST(HttpChunked, TrailerBytesAreBoundedWhateverTheyAre) {
  Limits limits;
  limits.max_head = 1024;
  for (const char filler : {'x', '\r'}) {
    ChunkedDecoder d;
    std::string body;
    const std::string data = "1\r\na\r\n0\r\n" + std::string(4096, filler);
    size_t used = 0;
    EXPECT_EQ(d.feed(data, &used, &body, limits), ChunkedDecoder::Status::kError) << int(filler);
    EXPECT_EQ(d.error().status, 431);
  }
}

TEST(HttpResponse, HeadIsWellFormed) {
  Response res;
  res.status = 405;
  res.set_header("Allow", "POST, OPTIONS");
  res.set_header("X-Evil", "a\r\nInjected: 1");
  EXPECT_EQ(serialize_head(res, false, 5),
            "HTTP/1.1 405 Method Not Allowed\r\nContent-Type: application/json\r\n"
            "Content-Length: 5\r\nConnection: close\r\nAllow: POST, OPTIONS\r\n"
            "X-Evil: a  Injected: 1\r\n\r\n");
  res.status = 200;
  res.headers.clear();
  res.content_type = "text/event-stream";
  EXPECT_EQ(serialize_head(res, true, std::nullopt),
            "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n"
            "Connection: keep-alive\r\n\r\n");
  EXPECT_EQ(percent_decode("Qwen%2FQwen3%20x"), "Qwen/Qwen3 x");
  EXPECT_FALSE(percent_decode("bad%2"));
  EXPECT_FALSE(percent_decode("bad%zz"));
}

}  // namespace
}  // namespace recur::server::http
