// Fuzz targets: each takes arbitrary bytes, feeds them to one surface that reads untrusted
// input, and checks what must hold for every input (no crash, no exception escaping, errors
// that name a client's fault as one, streamed results equal to whole ones). A failed check
// aborts. libFuzzer drives them in the fuzz build (scripts/fuzz.sh); test_fuzz replays the
// committed corpus (tests/fuzz/corpus/<name>/) through them in every build.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <span>
#include <string_view>

#include "tokenizer/utf8_util.h"

namespace recur::fuzz {

// Aborts with what failed: the fuzzer records the input, a replay names the check.
#define FUZZ_CHECK(cond)                                                                  \
  do {                                                                                    \
    if (!(cond)) {                                                                        \
      std::fprintf(stderr, "fuzz check failed: %s (%s:%d)\n", #cond, __FILE__, __LINE__); \
      std::abort();                                                                       \
    }                                                                                     \
  } while (0)

// HTTP/1.1 request heads and chunked bodies (server/http_message.h), split as a socket might.
int fuzz_http(const uint8_t* data, size_t size);
// API request bodies through every endpoint's parser, against Qwen's, Qwen3.5's and Kimi's
// tokenizers and chat templates.
int fuzz_request(const uint8_t* data, size_t size);
// Generated text through the reasoning / tool-call parser in every format, whole and in pieces.
int fuzz_output(const uint8_t* data, size_t size);
// Text and ids through the tokenizers: encode, decode, streamed decode.
int fuzz_tokenizer(const uint8_t* data, size_t size);
// Chat template sources (Jinja) compiled and rendered.
int fuzz_template(const uint8_t* data, size_t size);
// Checkpoint headers (safetensors), config.json and tiktoken vocabularies.
int fuzz_checkpoint(const uint8_t* data, size_t size);
// Submissions, cancellations and steps of the engine on tiny models, with and without the
// prefix cache: every request ends once, with its tokens alone, and frees what it held.
int fuzz_engine(const uint8_t* data, size_t size);
// JSON schemas compiled, and text matched against them (structured outputs).
int fuzz_schema(const uint8_t* data, size_t size);

struct Target {
  const char* name;
  int (*run)(const uint8_t*, size_t);
};

inline constexpr Target kTargets[] = {
    {"http", fuzz_http},           {"request", fuzz_request},   {"output", fuzz_output},
    {"tokenizer", fuzz_tokenizer}, {"template", fuzz_template}, {"checkpoint", fuzz_checkpoint},
    {"engine", fuzz_engine},       {"schema", fuzz_schema},
};

inline bool valid_utf8(std::string_view s) {
  return !find_invalid_utf8(s).has_value();
}

// Splits fuzz input into pieces at a separator byte, so one input can carry several fields.
inline std::span<const uint8_t> take_piece(std::span<const uint8_t>* rest, uint8_t separator) {
  size_t i = 0;
  while (i < rest->size() && (*rest)[i] != separator) ++i;
  std::span<const uint8_t> piece = rest->first(i);
  *rest = rest->subspan(i < rest->size() ? i + 1 : i);
  return piece;
}

}  // namespace recur::fuzz
