#include "tokenizer/tokenizer.h"

#include <algorithm>
#include <deque>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <unordered_map>

#include "io/json_text.h"
#include "io/mapped_file.h"
#include "tokenizer/added_vocabulary.h"
#include "tokenizer/bpe.h"
#include "tokenizer/normalizer.h"
#include "tokenizer/pretokenizer.h"
#include "tokenizer/tiktoken.h"
#include "tokenizer/utf8_util.h"

namespace recur {

using json = nlohmann::json;

struct Tokenizer::Impl {
  Impl(Normalizer n, PreTokenizer p, BpeModel m, AddedVocabulary a)
      : normalizer(std::move(n)),
        pre_tokenizer(std::move(p)),
        model(std::move(m)),
        added(std::move(a)) {}

  Normalizer normalizer;
  PreTokenizer pre_tokenizer;
  BpeModel model;
  AddedVocabulary added;
  TokenIdMap added_ids;  // content -> id of added tokens, which take precedence over the model
  ChunkLimits chunks;    // tiktoken (Kimi): runs of text are pre-tokenized in chunks

  // Per id, for decoding. An id no token uses has present == 0.
  std::vector<std::string> id_bytes;
  std::vector<uint8_t> present;
  std::vector<uint8_t> special;
  std::vector<int32_t> added_index;  // index into added.tokens(), or -1
  size_t max_token_bytes = 1;        // the most text bytes one token stands for

  std::string_view token_of(int32_t id) const {
    int32_t a = added_index[id];
    return a >= 0 ? std::string_view(added.tokens()[a].content) : model.id_to_token(id);
  }
  bool id_to_token_is(int32_t id, std::string_view content) const {
    return id >= 0 && static_cast<size_t>(id) < present.size() && present[id] &&
           token_of(id) == content;
  }
};

namespace {

const json& field(const json& j, const char* name) {
  static const json kNull;
  return j.contains(name) ? j[name] : kNull;
}

// Only ByteLevel decoding is supported: it makes decode a per-token byte concatenation, which
// is what lets StreamingDetokenizer work token by token.
Status check_decoder(const json& d) {
  if (!d.is_object() || !d.contains("type") || !d["type"].is_string()) {
    return make_error(ErrorCode::kUnsupported,
                      "tokenizer.json: a decoder of type ByteLevel is required");
  }
  std::string type = d["type"].get<std::string>();
  if (type == "ByteLevel") return {};
  if (type == "Sequence" && d.contains("decoders") && d["decoders"].is_array() &&
      !d["decoders"].empty()) {
    for (const json& s : d["decoders"]) RECUR_RETURN_IF_ERROR(check_decoder(s));
    return {};
  }
  return make_error(ErrorCode::kUnsupported,
                    "tokenizer.json: decoder type \"{}\" is not supported (supported: ByteLevel)",
                    type);
}

// Hugging Face's ByteLevel decoder: a token whose characters all belong to the byte alphabet
// becomes those bytes; any other token (an added token with a space, say) stays as written.
std::string byte_level_decode(std::string_view token) {
  std::string bytes;
  const auto* p = reinterpret_cast<const uint8_t*>(token.data());
  for (size_t i = 0; i < token.size();) {
    Utf8Step s = utf8_step(p + i, token.size() - i);
    int byte = s.kind == Utf8Step::kChar ? unicode_to_byte(decode_utf8_char(p + i, s.length)) : -1;
    if (byte < 0) return std::string(token);
    bytes.push_back(static_cast<char>(byte));
    i += s.length;
  }
  return bytes;
}

}  // namespace

Status Tokenizer::index_ids(Impl& im, const std::string& origin) {
  // Per-id tables are sized by the largest id: checked against the ids in use first.
  int64_t max_id = int64_t(im.model.vocab_size()) - 1;
  int64_t distinct = im.model.token_count();
  std::unordered_map<int32_t, const AddedToken*> added_by_id;
  for (const AddedToken& t : im.added.tokens()) {
    auto [it, inserted] = added_by_id.emplace(t.id, &t);
    if (!inserted && it->second->content != t.content) {
      return make_error(ErrorCode::kCorrupt, "{}: added tokens \"{}\" and \"{}\" both have id {}",
                        origin, it->second->content, t.content, t.id);
    }
    if (inserted && im.model.id_to_token(t.id).empty()) ++distinct;
    max_id = std::max<int64_t>(max_id, t.id);
  }
  RECUR_RETURN_IF_ERROR(check_id_range(max_id, distinct, origin, "vocab and added-token"));
  const int32_t size = static_cast<int32_t>(max_id + 1);
  im.id_bytes.resize(size);
  im.present.assign(size, 0);
  im.special.assign(size, 0);
  im.added_index.assign(size, -1);
  const auto& added_tokens = im.added.tokens();
  for (size_t i = 0; i < added_tokens.size(); ++i) {
    const AddedToken& t = added_tokens[i];
    im.added_ids.emplace(t.content, t.id);  // the first of duplicate contents wins
    im.added_index[t.id] = static_cast<int32_t>(i);
  }
  for (int32_t id = 0; id < size; ++id) {
    std::string_view token = im.token_of(id);
    if (im.added_index[id] < 0 && token.empty()) continue;
    im.present[id] = 1;
    im.id_bytes[id] = byte_level_decode(token);
    im.max_token_bytes = std::max(im.max_token_bytes, im.id_bytes[id].size());
  }
  // An added token is matched on its content, which may be longer than what it decodes to.
  for (const AddedToken& t : added_tokens) {
    im.max_token_bytes = std::max(im.max_token_bytes, t.content.size());
  }
  // Counted against the text before normalization, which may shorten it.
  im.max_token_bytes *= im.normalizer.max_shrink();
  // Special-ness follows the token's content, as Hugging Face checks it when decoding: a
  // model token spelled like a special token is special too.
  for (const AddedToken& t : added_tokens) {
    if (!t.special) continue;
    if (im.id_to_token_is(t.id, t.content)) im.special[t.id] = 1;
    std::optional<int32_t> model_id = im.model.token_to_id(t.content);
    if (model_id && im.id_to_token_is(*model_id, t.content)) im.special[*model_id] = 1;
  }
  return {};
}

Result<Tokenizer> Tokenizer::load(const std::string& model_dir) {
  return load(model_dir, TokenizerOptions{});
}

bool Tokenizer::found_in(const std::string& model_dir) {
  const std::filesystem::path dir(model_dir);
  return std::filesystem::exists(dir / "tokenizer.json") ||
         std::filesystem::exists(dir / "tiktoken.model");
}

Result<Tokenizer> Tokenizer::load(const std::string& model_dir, const TokenizerOptions& options) {
  const std::filesystem::path dir(model_dir);
  const std::string path = (dir / "tokenizer.json").string();
  if (std::filesystem::exists(path)) {
    RECUR_ASSIGN_OR_RETURN(std::string text, read_text_file(path));
    return from_json_text(text, path, options);
  }
  const std::string ranks_path = (dir / "tiktoken.model").string();
  if (!std::filesystem::exists(ranks_path)) {
    return make_error(ErrorCode::kNotFound, "{} has neither tokenizer.json nor tiktoken.model",
                      model_dir);
  }
  const std::string config_path = (dir / "tokenizer_config.json").string();
  if (!std::filesystem::exists(config_path)) {
    return make_error(ErrorCode::kNotFound,
                      "{} does not exist; tiktoken.model needs it for its added tokens and "
                      "pre-tokenizer",
                      config_path);
  }
  RECUR_ASSIGN_OR_RETURN(std::string ranks, read_text_file(ranks_path));
  RECUR_ASSIGN_OR_RETURN(std::string config, read_text_file(config_path));
  return from_tiktoken(ranks, config, model_dir, options);
}

Result<Tokenizer> Tokenizer::from_tiktoken(std::string_view ranks_text,
                                           std::string_view config_text, const std::string& origin,
                                           const TokenizerOptions& options) {
  const std::string ranks_origin = origin + "/tiktoken.model";
  const std::string config_origin = origin + "/tokenizer_config.json";
  RECUR_ASSIGN_OR_RETURN(json config, parse_json(config_text, config_origin));
  RECUR_ASSIGN_OR_RETURN(std::vector<RankedToken> ranks,
                         parse_tiktoken_ranks(ranks_text, ranks_origin));
  RECUR_ASSIGN_OR_RETURN(TiktokenConfig tc,
                         read_tiktoken_config(config, ranks.size(), config_origin));
  RECUR_ASSIGN_OR_RETURN(std::string pattern, translate_tiktoken_pattern(tc.pattern));
  auto regex = Regex::compile(pattern);
  if (!regex.ok()) {
    return make_error(ErrorCode::kCorrupt, "{}: pre-tokenizer pattern /{}/: {}", config_origin,
                      tc.pattern, regex.error().message);
  }
  try {
    RECUR_ASSIGN_OR_RETURN(Normalizer normalizer, Normalizer::from_json(json()));
    RECUR_ASSIGN_OR_RETURN(BpeModel model,
                           BpeModel::from_ranks(ranks, ranks_origin, options.word_cache));
    RECUR_ASSIGN_OR_RETURN(AddedVocabulary added,
                           AddedVocabulary::from_json(tc.added_tokens, normalizer, config_origin));
    auto impl =
        std::make_shared<Impl>(std::move(normalizer), PreTokenizer::matches_of(std::move(*regex)),
                               std::move(model), std::move(added));
    impl->chunks = tc.chunks;
    RECUR_RETURN_IF_ERROR(index_ids(*impl, origin));
    return Tokenizer(std::move(impl));
  } catch (const json::exception& e) {
    return make_error(ErrorCode::kCorrupt, "{}: unexpected structure: {}", config_origin, e.what());
  }
}

Result<Tokenizer> Tokenizer::from_json_text(std::string_view json_text, const std::string& origin,
                                            const TokenizerOptions& options) {
  RECUR_ASSIGN_OR_RETURN(json j, parse_json(json_text, origin));
  if (!j.is_object()) return make_error(ErrorCode::kCorrupt, "{}: not a JSON object", origin);

  auto build = [&]() -> Result<std::shared_ptr<Impl>> {
    RECUR_ASSIGN_OR_RETURN(Normalizer normalizer, Normalizer::from_json(field(j, "normalizer")));
    RECUR_ASSIGN_OR_RETURN(PreTokenizer pre, PreTokenizer::from_json(field(j, "pre_tokenizer")));
    RECUR_RETURN_IF_ERROR(check_decoder(field(j, "decoder")));
    RECUR_ASSIGN_OR_RETURN(BpeModel model, BpeModel::from_json(field(j, "model"), pre.byte_level(),
                                                               options.word_cache));
    RECUR_ASSIGN_OR_RETURN(AddedVocabulary added,
                           AddedVocabulary::from_json(field(j, "added_tokens"), normalizer));
    auto impl = std::make_shared<Impl>(std::move(normalizer), std::move(pre), std::move(model),
                                       std::move(added));
    RECUR_RETURN_IF_ERROR(index_ids(*impl, origin));
    return impl;
  };
  try {
    RECUR_ASSIGN_OR_RETURN(std::shared_ptr<Impl> impl, build());
    return Tokenizer(std::move(impl));
  } catch (const json::exception& e) {
    return make_error(ErrorCode::kCorrupt, "{}: unexpected structure: {}", origin, e.what());
  }
}

Result<std::vector<int32_t>> Tokenizer::encode(std::string_view text) const {
  return encode(text, {});
}

Result<std::vector<int32_t>> Tokenizer::encode(
    std::string_view text, std::span<const std::pair<size_t, size_t>> literal) const {
  for (size_t i = 0; i < literal.size(); ++i) {
    if (literal[i].first >= literal[i].second || literal[i].second > text.size() ||
        (i > 0 && literal[i].first < literal[i - 1].second)) {
      return make_error(ErrorCode::kInternal,
                        "literal range {} [{}, {}) is empty, unsorted or past the text's {} bytes",
                        i, literal[i].first, literal[i].second, text.size());
    }
  }
  if (std::optional<size_t> bad = find_invalid_utf8(text)) {
    return make_error(ErrorCode::kInvalidArgument,
                      "text is not valid UTF-8: byte 0x{:02X} at byte offset {}",
                      static_cast<uint8_t>(text[*bad]), *bad);
  }
  const Impl& im = *impl_;
  std::vector<int32_t> ids;
  ids.reserve(text.size() / 3 + 1);
  std::vector<AddedVocabulary::Segment> raw_segments, segments;
  std::deque<std::string> arena;
  std::string normalized_storage;

  im.added.split(text, /*normalized_tokens=*/false, raw_segments, {literal, 0, false});
  for (const AddedVocabulary::Segment& raw : raw_segments) {
    if (raw.id >= 0) {
      ids.push_back(raw.id);
      continue;
    }
    // Each run between raw-matched tokens is normalized on its own, as Hugging Face does.
    RECUR_ASSIGN_OR_RETURN(std::string_view normalized,
                           im.normalizer.normalize(raw.text, normalized_storage));
    segments.clear();
    if (im.added.has_normalized_tokens()) {
      // Literal ranges index the raw text; they carry over where normalizing changed nothing,
      // else the whole run counts as literal if any of it is.
      const size_t raw_at = static_cast<size_t>(raw.text.data() - text.data());
      AddedVocabulary::Literal in_run{literal, raw_at, false};
      if (normalized != raw.text) {
        in_run = {{}, 0, in_run.overlaps(0, raw.text.size())};
      }
      im.added.split(normalized, /*normalized_tokens=*/true, segments, in_run);
    } else {
      segments.push_back({normalized, -1});
    }
    for (const AddedVocabulary::Segment& seg : segments) {
      if (seg.id >= 0) {
        ids.push_back(seg.id);
        continue;
      }
      RECUR_RETURN_IF_ERROR(
          for_each_chunk(seg.text, im.chunks, [&](std::string_view chunk) -> Status {
            arena.clear();
            return im.pre_tokenizer.split(
                chunk, arena, [&](std::string_view piece) { im.model.encode_piece(piece, ids); });
          }));
    }
  }
  return ids;
}

std::string Tokenizer::decode(std::span<const int32_t> ids, bool skip_special_tokens) const {
  const Impl& im = *impl_;
  std::string bytes;
  for (int32_t id : ids) {
    if (id < 0 || static_cast<size_t>(id) >= im.present.size() || !im.present[id]) continue;
    if (skip_special_tokens && im.special[id]) continue;
    bytes += im.id_bytes[id];
  }
  std::string out;
  out.reserve(bytes.size());
  append_utf8_lossy(out, bytes);
  return out;
}

int Tokenizer::vocab_size() const {
  return static_cast<int>(impl_->present.size());
}

std::optional<int32_t> Tokenizer::token_to_id(std::string_view token) const {
  if (auto it = impl_->added_ids.find(token); it != impl_->added_ids.end()) return it->second;
  return impl_->model.token_to_id(token);
}

std::string_view Tokenizer::id_to_token(int32_t id) const {
  if (id < 0 || static_cast<size_t>(id) >= impl_->present.size()) return {};
  return impl_->token_of(id);
}

std::string_view Tokenizer::id_to_bytes(int32_t id) const {
  if (id < 0 || static_cast<size_t>(id) >= impl_->present.size()) return {};
  return impl_->id_bytes[id];
}

size_t Tokenizer::max_token_bytes() const {
  return impl_->max_token_bytes;
}

bool Tokenizer::is_special(int32_t id) const {
  return id >= 0 && static_cast<size_t>(id) < impl_->special.size() && impl_->special[id];
}

StreamingDetokenizer::StreamingDetokenizer(const Tokenizer& tok, bool skip_special_tokens)
    : tok_(tok), skip_special_(skip_special_tokens) {}

void StreamingDetokenizer::push(int32_t id, std::string* out) {
  if (skip_special_ && tok_.is_special(id)) return;
  pending_ += tok_.id_to_bytes(id);
  const size_t stable = utf8_stable_prefix(pending_);
  append_utf8_lossy(*out, std::string_view(pending_).substr(0, stable));
  pending_.erase(0, stable);
}

void StreamingDetokenizer::flush(std::string* out) {
  append_utf8_lossy(*out, pending_);
  pending_.clear();
}

}  // namespace recur
