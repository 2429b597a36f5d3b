#include "server/http_message.h"

#include <fmt/format.h>

#include <algorithm>

#include "server/ascii.h"

namespace recur::server::http {

namespace {

bool is_tchar(unsigned char c) {
  if (c >= '0' && c <= '9') return true;
  if ((c | 0x20) >= 'a' && (c | 0x20) <= 'z') return true;
  switch (c) {
    case '!':
    case '#':
    case '$':
    case '%':
    case '&':
    case '\'':
    case '*':
    case '+':
    case '-':
    case '.':
    case '^':
    case '_':
    case '`':
    case '|':
    case '~':
      return true;
    default:
      return false;
  }
}

int hex_value(unsigned char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

std::string lower(std::string_view s) {
  std::string out(s);
  for (char& c : out) {
    if (c >= 'A' && c <= 'Z') c = char(c + 32);
  }
  return out;
}

std::string_view trim_ows(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t')) s.remove_suffix(1);
  return s;
}

// A printable excerpt of client bytes for an error message.
std::string excerpt(std::string_view s, size_t max = 40) {
  std::string out;
  for (size_t i = 0; i < s.size() && i < max; ++i) {
    const unsigned char c = static_cast<unsigned char>(s[i]);
    if (c >= 0x20 && c < 0x7f && c != '\\' && c != '\'') {
      out += char(c);
    } else {
      out += fmt::format("\\x{:02x}", c);
    }
  }
  if (s.size() > max) out += "...";
  return out;
}

ParseError error(int status, std::string message) {
  return ParseError{status, std::move(message)};
}

}  // namespace

const std::string* Request::header(std::string_view lower_name) const {
  for (const Header& h : headers) {
    if (h.name == lower_name) return &h.value;
  }
  return nullptr;
}

std::variant<std::optional<size_t>, ParseError> find_head_end(std::string_view buf, size_t* scanned,
                                                              const Limits& limits) {
  size_t pos = *scanned;  // always the start of a line
  const size_t first = buf.find_first_not_of("\r\n");
  while (pos < buf.size()) {
    const size_t nl = buf.find('\n', pos);
    if (nl == std::string_view::npos) break;
    const size_t len = nl - pos;
    const bool empty = len == 0 || (len == 1 && buf[pos] == '\r');
    if (len > limits.max_line + 1) {
      const bool request_line = first != std::string_view::npos && pos <= first;
      return request_line
                 ? error(414,
                         fmt::format("the request line is longer than {} bytes", limits.max_line))
                 : error(431,
                         fmt::format("a header line is longer than {} bytes", limits.max_line));
    }
    pos = nl + 1;
    if (nl + 1 > limits.max_head) {
      return error(431, fmt::format("the request head is larger than {} bytes", limits.max_head));
    }
    // Empty lines before the request line are ignored (RFC 9112 2.2).
    if (empty && first != std::string_view::npos && first < nl) {
      *scanned = pos;
      return std::optional<size_t>(pos);
    }
  }
  *scanned = pos;
  if (buf.size() - pos > limits.max_line + 1) {
    const bool request_line = first == std::string_view::npos || pos <= first;
    return request_line
               ? error(414,
                       fmt::format("the request line is longer than {} bytes", limits.max_line))
               : error(431, fmt::format("a header line is longer than {} bytes", limits.max_line));
  }
  if (buf.size() > limits.max_head) {
    return error(431, fmt::format("the request head is larger than {} bytes", limits.max_head));
  }
  return std::optional<size_t>();
}

namespace {

std::variant<bool, ParseError> parse_target(Request* r) {
  std::string_view t = r->target;
  for (unsigned char c : t) {
    if (c <= 0x20 || c >= 0x7f) {
      return error(400, "the request target holds a byte that must be percent-encoded");
    }
    if (c == '#') return error(400, "the request target holds a fragment ('#')");
  }
  if (t == "*") {
    if (r->method != "OPTIONS") return error(400, "the request target '*' is only for OPTIONS");
    r->path.assign(1, '*');  // (assigning a literal trips GCC 12's -Wrestrict)
    return true;
  }
  if (t.rfind("http://", 0) == 0 || t.rfind("https://", 0) == 0) {  // absolute-form
    const size_t authority = t.find("//") + 2;
    const size_t slash = t.find_first_of("/?", authority);
    t = slash == std::string_view::npos ? std::string_view("/") : t.substr(slash);
    if (t.front() == '?') {
      r->path.assign(1, '/');
      r->query = std::string(t.substr(1));
      return true;
    }
  }
  if (t.empty() || t.front() != '/') {
    return error(400, fmt::format("the request target '{}' does not start with '/'", excerpt(t)));
  }
  const size_t q = t.find('?');
  r->path = std::string(t.substr(0, q));
  if (q != std::string_view::npos) r->query = std::string(t.substr(q + 1));
  return true;
}

std::variant<bool, ParseError> parse_request_line(std::string_view line, Request* r) {
  const size_t sp1 = line.find(' ');
  const size_t sp2 = sp1 == std::string_view::npos ? sp1 : line.find(' ', sp1 + 1);
  if (sp1 == std::string_view::npos || sp2 == std::string_view::npos ||
      line.find(' ', sp2 + 1) != std::string_view::npos) {
    return error(400, fmt::format("malformed request line '{}' (want METHOD /path HTTP/1.1)",
                                  excerpt(line)));
  }
  const std::string_view method = line.substr(0, sp1);
  const std::string_view target = line.substr(sp1 + 1, sp2 - sp1 - 1);
  const std::string_view version = line.substr(sp2 + 1);
  if (method.empty() || !std::all_of(method.begin(), method.end(), [](char c) {
        return is_tchar(static_cast<unsigned char>(c));
      })) {
    return error(400, fmt::format("malformed method '{}'", excerpt(method)));
  }
  if (target.empty()) return error(400, "the request line has no target");
  if (version == "HTTP/1.1") {
    r->minor_version = 1;
  } else if (version == "HTTP/1.0") {
    r->minor_version = 0;
  } else if (version.size() == 8 && version.rfind("HTTP/", 0) == 0 && isdigit(version[5]) &&
             version[6] == '.' && isdigit(version[7])) {
    return error(505, fmt::format("{} is not supported; use HTTP/1.1", version));
  } else {
    return error(400, fmt::format("malformed HTTP version '{}'", excerpt(version)));
  }
  r->method = std::string(method);
  r->target = std::string(target);
  return parse_target(r);
}

std::variant<bool, ParseError> parse_header_line(std::string_view line, Request* r) {
  if (line.front() == ' ' || line.front() == '\t') {
    return error(400, "obsolete line folding (a header line starting with whitespace)");
  }
  const size_t colon = line.find(':');
  if (colon == std::string_view::npos) {
    return error(400, fmt::format("header line without a colon: '{}'", excerpt(line)));
  }
  const std::string_view name = line.substr(0, colon);
  if (name.empty()) return error(400, "header line with an empty name");
  for (unsigned char c : name) {
    if (c == ' ' || c == '\t') {
      return error(400, fmt::format("whitespace before the colon in header '{}'", excerpt(name)));
    }
    if (!is_tchar(c)) return error(400, fmt::format("malformed header name '{}'", excerpt(name)));
  }
  const std::string_view value = trim_ows(line.substr(colon + 1));
  for (unsigned char c : value) {
    if (c == 0) return error(400, fmt::format("NUL byte in header '{}'", excerpt(name)));
    if ((c < 0x20 && c != '\t') || c == 0x7f) {
      return error(400, fmt::format("control character in header '{}'", excerpt(name)));
    }
  }
  r->headers.push_back({lower(name), std::string(value)});
  return true;
}

// Content-Length, Transfer-Encoding, Host, Connection, Expect, Content-Encoding.
std::variant<bool, ParseError> check_framing(Request* r) {
  int hosts = 0, lengths = 0, encodings = 0;
  const std::string* length = nullptr;
  const std::string* encoding = nullptr;
  bool close = false, keep_alive = false;
  for (const Header& h : r->headers) {
    if (h.name == "host") {
      ++hosts;
    } else if (h.name == "content-length") {
      ++lengths;
      length = &h.value;
    } else if (h.name == "transfer-encoding") {
      ++encodings;
      encoding = &h.value;
    } else if (h.name == "connection") {
      std::string_view v = h.value;
      while (!v.empty()) {
        const size_t comma = v.find(',');
        const std::string_view token = trim_ows(v.substr(0, comma));
        if (iequals(token, "close")) close = true;
        if (iequals(token, "keep-alive")) keep_alive = true;
        if (comma == std::string_view::npos) break;
        v.remove_prefix(comma + 1);
      }
    } else if (h.name == "expect") {
      if (!iequals(h.value, "100-continue")) {
        return error(417, fmt::format("Expect '{}' is not supported", excerpt(h.value)));
      }
      r->expect_continue = r->minor_version >= 1;  // HTTP/1.0: ignored (RFC 9110 10.1.1)
    } else if (h.name == "content-encoding") {
      if (!iequals(h.value, "identity")) {
        return error(415, fmt::format("Content-Encoding '{}' is not supported; send the body "
                                      "uncompressed",
                                      excerpt(h.value)));
      }
    }
  }
  if (hosts > 1) return error(400, "more than one Host header");
  if (hosts == 0 && r->minor_version == 1)
    return error(400, "HTTP/1.1 requests need a Host header");
  if (lengths > 1) return error(400, "more than one Content-Length header");
  if (encodings > 1) return error(400, "more than one Transfer-Encoding header");
  if (length) {
    if (length->empty() || length->size() > 18 ||
        !std::all_of(length->begin(), length->end(), [](char c) { return c >= '0' && c <= '9'; })) {
      return error(400, fmt::format("invalid Content-Length '{}' (want a decimal byte count)",
                                    excerpt(*length)));
    }
    r->content_length = std::stoull(*length);
  }
  if (encoding) {
    if (r->minor_version == 0) return error(400, "Transfer-Encoding in an HTTP/1.0 request");
    if (!iequals(*encoding, "chunked")) {
      return error(501, fmt::format("Transfer-Encoding '{}' is not supported (only chunked)",
                                    excerpt(*encoding)));
    }
    if (length) return error(400, "both Content-Length and Transfer-Encoding are present");
    r->chunked = true;
  }
  r->keep_alive = r->minor_version == 1 ? !close : (keep_alive && !close);
  return true;
}

}  // namespace

std::variant<Request, ParseError> parse_head(std::string_view head, const Limits& limits) {
  Request r;
  bool have_request_line = false;
  size_t pos = 0;
  while (pos < head.size()) {
    size_t nl = head.find('\n', pos);
    if (nl == std::string_view::npos) nl = head.size();
    std::string_view line = head.substr(pos, nl - pos);
    pos = nl + 1;
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    if (line.find('\r') != std::string_view::npos) {
      return error(400, "a bare CR inside a line of the request head");
    }
    if (line.empty()) {
      if (!have_request_line) continue;  // leading empty lines
      break;                             // the end of the head
    }
    std::variant<bool, ParseError> ok;
    if (!have_request_line) {
      ok = parse_request_line(line, &r);
      have_request_line = true;
    } else {
      if (r.headers.size() >= limits.max_headers) {
        return error(431, fmt::format("more than {} header lines", limits.max_headers));
      }
      ok = parse_header_line(line, &r);
    }
    if (auto* e = std::get_if<ParseError>(&ok)) return std::move(*e);
  }
  if (!have_request_line) return error(400, "empty request");
  auto ok = check_framing(&r);
  if (auto* e = std::get_if<ParseError>(&ok)) return std::move(*e);
  return r;
}

ChunkedDecoder::Status ChunkedDecoder::fail(int status, std::string message) {
  error_ = ParseError{status, std::move(message)};
  return Status::kError;
}

ChunkedDecoder::Status ChunkedDecoder::feed(std::string_view data, size_t* consumed,
                                            std::string* body, const Limits& limits) {
  size_t i = 0;
  while (i < data.size() && state_ != State::kDone) {
    const unsigned char c = static_cast<unsigned char>(data[i]);
    switch (state_) {
      case State::kSize: {
        const int h = hex_value(c);
        if (h >= 0) {
          if (++digits_ > 15) return fail(400, "chunk size has too many digits");
          size_ = size_ * 16 + uint64_t(h);
          ++i;
          break;
        }
        if (digits_ == 0) return fail(400, "invalid chunk size (want hex digits)");
        state_ = State::kSizeSpace;
        break;  // c is looked at again
      }
      case State::kSizeSpace:
        if (c == ' ' || c == '\t') {
          if (++ext_ > limits.max_chunk_ext) return fail(400, "chunk extension too long");
          ++i;
        } else if (c == ';') {
          state_ = State::kExt;
          ++i;
        } else if (c == '\r') {
          state_ = State::kSizeLf;
          ++i;
        } else if (c == '\n') {
          state_ = State::kSizeLf;  // a bare LF ends the line too
        } else {
          return fail(400, "invalid chunk size (want hex digits)");
        }
        break;
      case State::kExt:
        if (c == '\r') {
          state_ = State::kSizeLf;
          ++i;
        } else if (c == '\n') {
          state_ = State::kSizeLf;
        } else if (c == 0 || ++ext_ > limits.max_chunk_ext) {
          return fail(400, "chunk extension too long or holding a NUL");
        } else {
          ++i;
        }
        break;
      case State::kSizeLf:
        if (c != '\n') return fail(400, "chunk size line not ended by CRLF");
        ++i;
        ext_ = 0;
        digits_ = 0;
        if (size_ == 0) {
          state_ = State::kTrailer;
        } else if (body->size() + size_ > limits.max_body) {
          return fail(413, fmt::format("the request body is larger than {} bytes "
                                       "(--max-body-mb)",
                                       limits.max_body));
        } else {
          state_ = State::kData;
        }
        break;
      case State::kData: {
        const size_t take = size_t(std::min<uint64_t>(size_, data.size() - i));
        body->append(data.data() + i, take);
        i += take;
        size_ -= take;
        if (size_ == 0) state_ = State::kDataCr;
        break;
      }
      case State::kDataCr:
        if (c == '\r') {
          state_ = State::kDataLf;
          ++i;
        } else if (c == '\n') {
          state_ = State::kDataLf;
        } else {
          return fail(400, "chunk data longer than its chunk size");
        }
        break;
      case State::kDataLf:
        if (c != '\n') return fail(400, "chunk data not followed by CRLF");
        ++i;
        state_ = State::kSize;
        break;
      case State::kTrailer:
        // Trailer fields are read and dropped; an empty line ends the body. Every byte counts
        // toward the bound (CRs too: else endless CRs would be a body that never ends).
        if (++trailer_bytes_ > limits.max_head) return fail(431, "chunked trailer too large");
        if (c == '\n') {
          ++i;
          if (trailer_line_ == 0) {
            state_ = State::kDone;
          } else {
            trailer_line_ = 0;
          }
        } else if (c == '\r') {
          ++i;
        } else if (c == 0) {
          return fail(400, "NUL byte in a chunked trailer");
        } else {
          ++i;
          ++trailer_line_;
        }
        break;
      case State::kDone:
        break;
    }
  }
  *consumed = i;
  return state_ == State::kDone ? Status::kDone : Status::kNeedMore;
}

void Response::set_header(std::string name, std::string value) {
  for (Header& h : headers) {
    if (iequals(h.name, name)) {
      h.value = std::move(value);
      return;
    }
  }
  headers.push_back({std::move(name), std::move(value)});
}

const char* reason_phrase(int status) {
  switch (status) {
    case 100:
      return "Continue";
    case 200:
      return "OK";
    case 204:
      return "No Content";
    case 400:
      return "Bad Request";
    case 401:
      return "Unauthorized";
    case 403:
      return "Forbidden";
    case 404:
      return "Not Found";
    case 405:
      return "Method Not Allowed";
    case 408:
      return "Request Timeout";
    case 413:
      return "Content Too Large";
    case 414:
      return "URI Too Long";
    case 415:
      return "Unsupported Media Type";
    case 417:
      return "Expectation Failed";
    case 429:
      return "Too Many Requests";
    case 431:
      return "Request Header Fields Too Large";
    case 499:
      return "Client Closed Request";
    case 500:
      return "Internal Server Error";
    case 501:
      return "Not Implemented";
    case 503:
      return "Service Unavailable";
    case 505:
      return "HTTP Version Not Supported";
    default:
      return status < 400 ? "OK" : status < 500 ? "Bad Request" : "Internal Server Error";
  }
}

std::string serialize_head(const Response& res, bool keep_alive,
                           std::optional<size_t> content_length, bool chunked) {
  // Header values are ours or validated client bytes; a CR or LF must still never split them.
  auto clean = [](std::string_view v) {
    std::string s(v);
    for (char& c : s) {
      if (c == '\r' || c == '\n') c = ' ';
    }
    return s;
  };
  std::string out = fmt::format("HTTP/1.1 {} {}\r\n", res.status, reason_phrase(res.status));
  if (!res.content_type.empty() && res.status != 204) {
    out += "Content-Type: " + clean(res.content_type) + "\r\n";
  }
  if (res.status != 204 && content_length) {
    out += fmt::format("Content-Length: {}\r\n", *content_length);
  } else if (res.status != 204 && chunked) {
    out += "Transfer-Encoding: chunked\r\n";
  }
  out += keep_alive ? "Connection: keep-alive\r\n" : "Connection: close\r\n";
  for (const Header& h : res.headers) out += clean(h.name) + ": " + clean(h.value) + "\r\n";
  out += "\r\n";
  return out;
}

std::optional<std::string> percent_decode(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] != '%') {
      out += s[i];
      continue;
    }
    if (i + 2 >= s.size()) return std::nullopt;
    const int hi = hex_value(static_cast<unsigned char>(s[i + 1]));
    const int lo = hex_value(static_cast<unsigned char>(s[i + 2]));
    if (hi < 0 || lo < 0) return std::nullopt;
    out += char(hi * 16 + lo);
    i += 2;
  }
  return out;
}

}  // namespace recur::server::http
