// Structured outputs in the engine's terms: a compiled JSON schema as a TokenConstraint over a
// vocabulary's token bytes (response_format json_schema / json_object), and a forced tool call
// the same way (tool_choice required or named, JSON, Qwen3.5's XML or Kimi's call format).
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "engine/token_constraint.h"
#include "server/json_schema.h"
#include "server/tool_call_grammar.h"
#include "server/tool_call_kimi.h"
#include "server/tool_call_xml.h"
#include "tokenizer/tokenizer.h"

namespace recur::server {

// A vocabulary's tokens as bytes, sorted for masking; built once per tokenizer.
struct VocabularyBytes {
  std::vector<std::string> bytes;  // [vocab] each token's bytes
  // [vocab] 1: never text in a JSON value (special tokens, tokens of no bytes).
  std::vector<uint8_t> control;
  // [vocab] 1: continues any string between characters (no '"', '\\' or control bytes; whole
  // UTF-8 characters).
  std::vector<uint8_t> string_safe;
  std::vector<uint16_t> chars;  // [vocab] characters of a string-safe token
  // The text tokens by their first byte.
  std::array<std::vector<int32_t>, 256> by_first;
  static std::shared_ptr<const VocabularyBytes> build(const Tokenizer& tokenizer);
};

// A constraint that admits the tokens whose bytes keep the text a prefix of a JSON value the
// schema accepts, and the end tokens once the value is whole. With `active_after` (the
// reasoning's closing marker, for prompts that leave the model thinking), everything is
// admitted until the marker has been generated.
std::shared_ptr<const ConstraintSpec> json_constraint(std::shared_ptr<const CompiledSchema> schema,
                                                      std::shared_ptr<const VocabularyBytes> vocab,
                                                      std::vector<int32_t> end_ids,
                                                      std::string active_after);

// A constraint that admits the tokens whose bytes keep the text a prefix of the grammar's calls,
// and the end tokens once they are whole. It holds from the first generated token: the forced
// prefix in the prompt has already closed any reasoning (its "\n</think>\n\n").
std::shared_ptr<const ConstraintSpec> tool_call_constraint(
    std::shared_ptr<const ToolCallGrammar> grammar, std::shared_ptr<const VocabularyBytes> vocab,
    std::vector<int32_t> end_ids);
// The same for a forced call in the XML form.
std::shared_ptr<const ConstraintSpec> xml_call_constraint(
    std::shared_ptr<const XmlCallGrammar> grammar, std::shared_ptr<const VocabularyBytes> vocab,
    std::vector<int32_t> end_ids);

// `base` (the tokenizer's) as a forced Kimi call reads it: each marker (KimiCallGrammar::kMarkers)
// its reserved byte, in its own token (control or not) and in any text token holding it whole;
// text tokens holding a reserved byte of their own never admitted. Null when a marker is not one
// token of the tokenizer: such calls stay forced by their prefix alone.
std::shared_ptr<const VocabularyBytes> kimi_call_vocabulary(const Tokenizer& tokenizer,
                                                            const VocabularyBytes& base);
// The same for a forced call in Kimi's form, over kimi_call_vocabulary's vocabulary.
std::shared_ptr<const ConstraintSpec> kimi_call_constraint(
    std::shared_ptr<const KimiCallGrammar> grammar, std::shared_ptr<const VocabularyBytes> vocab,
    std::vector<int32_t> end_ids);

}  // namespace recur::server
