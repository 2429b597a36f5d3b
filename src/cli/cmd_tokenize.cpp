// `recur tokenize --model DIR --jsonl FILE`: encodes the "text" field of each JSON line, or
// renders a chat request line ({"messages": [...], "tools": ..., "add_generation_prompt": ...})
// with the model's chat template and encodes that as `recur serve` does, and prints one
// {"ids": [...]} line per input line, in order.
#include <cstdio>
#include <fstream>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>

#include "cli/commands.h"
#include "tokenizer/chat_template.h"
#include "tokenizer/tokenizer.h"
#include "tokenizer/utf8_util.h"

namespace recur::cli {

namespace {

struct TokenizeOptions {
  std::string model_dir;
  std::string jsonl;
  ChatTemplateOptions chat;
};

[[noreturn]] void fail(const std::string& message) {
  std::fflush(stdout);
  std::fprintf(stderr, "recur tokenize: %s\n", message.c_str());
  exit_with(1);
}

void run_tokenize(const TokenizeOptions& opts) {
  Result<Tokenizer> tok = Tokenizer::load(opts.model_dir);
  if (!tok.ok()) fail(tok.error().to_string());
  std::optional<ChatTemplate> chat_template;  // loaded at the first chat request

  std::ifstream file;
  std::istream* in = &std::cin;
  if (opts.jsonl != "-") {
    file.open(opts.jsonl, std::ios::binary);
    if (!file) fail(fmt::format("cannot open {}", opts.jsonl));
    in = &file;
  }

  std::string line;
  std::string out;
  size_t line_number = 0;
  while (std::getline(*in, line)) {
    ++line_number;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;  // blank line
    auto where = [&] { return fmt::format("{}:{}", opts.jsonl, line_number); };
    // Checked before parsing so the message can name the byte rather than a JSON position.
    if (std::optional<size_t> bad = find_invalid_utf8(line)) {
      fail(fmt::format("{}: invalid UTF-8 at byte offset {} of the line", where(), *bad));
    }
    // ordered_json keeps a chat request's key order, which tojson reproduces.
    nlohmann::ordered_json j;
    try {
      j = nlohmann::ordered_json::parse(line);
    } catch (const nlohmann::ordered_json::parse_error& e) {
      fail(fmt::format("{}: invalid JSON: {}", where(), e.what()));
    }
    Result<std::vector<int32_t>> ids = std::vector<int32_t>();
    if (j.is_object() && j.contains("messages")) {
      if (!chat_template) {
        auto t = ChatTemplate::load(opts.model_dir, opts.chat);
        if (!t.ok()) fail(fmt::format("{}: {}", where(), t.error().to_string()));
        chat_template = std::move(*t);
      }
      Result<RenderedPrompt> prompt = chat_template->render_prompt(j);
      if (!prompt.ok()) fail(fmt::format("{}: {}", where(), prompt.error().to_string()));
      ids = tok->encode(prompt->text, prompt->literal);
    } else if (j.is_object() && j.contains("text") && j["text"].is_string()) {
      ids = tok->encode(j["text"].get_ref<const std::string&>());
    } else {
      fail(fmt::format(
          "{}: expected an object with a string field \"text\" or a chat request (\"messages\")",
          where()));
    }
    if (!ids.ok()) fail(fmt::format("{}: {}", where(), ids.error().to_string()));
    out += "{\"ids\": [";
    for (size_t i = 0; i < ids->size(); ++i) {
      if (i > 0) out += ", ";
      out += std::to_string((*ids)[i]);
    }
    out += "]}\n";
    if (out.size() > (1u << 16)) {
      std::fwrite(out.data(), 1, out.size(), stdout);
      out.clear();
    }
  }
  if (in->bad()) fail(fmt::format("{}: read error after line {}", opts.jsonl, line_number));
  std::fwrite(out.data(), 1, out.size(), stdout);
  if (std::fflush(stdout) != 0 || std::ferror(stdout)) fail("cannot write to stdout");
}

}  // namespace

void register_tokenize(CLI::App& app) {
  auto opts = std::make_shared<TokenizeOptions>();
  CLI::App* cmd = app.add_subcommand(
      "tokenize",
      "Encode the \"text\" field (or the chat request) of each JSON line; print {\"ids\": [...]} "
      "per line");
  cmd->add_option("--model", opts->model_dir,
                  "Model directory holding tokenizer.json or tiktoken.model")
      ->required();
  cmd->add_option("--jsonl", opts->jsonl, "Input file of JSON lines ('-' for stdin)")->required();
  auto special = std::make_shared<bool>(false);
  cmd->add_flag("--special-tokens-in-requests", *special,
                "chat requests: special-token strings written in messages or tools become "
                "control tokens (as in transformers); by default they stay text");
  cmd->callback([opts, special] {
    opts->chat.request_special_tokens_as_text = !*special;
    run_tokenize(*opts);
  });
}

}  // namespace recur::cli
