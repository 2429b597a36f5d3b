// `recur chat-template`: prints the prompt a chat request renders to, byte for byte, as
// transformers' apply_chat_template(tokenize=False) would produce it.
#include <cstdio>
#include <iostream>
#include <iterator>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>

#include "cli/commands.h"
#include "io/mapped_file.h"
#include "tokenizer/chat_template.h"

namespace recur::cli {

namespace {

struct ChatTemplateOptions {
  std::string model_dir;
  std::string request_path;
};

[[noreturn]] void fail(const std::string& message) {
  std::fprintf(stderr, "recur chat-template: %s\n", message.c_str());
  exit_with(1);
}

void run_chat_template(const ChatTemplateOptions& opts) {
  std::string text;
  if (opts.request_path == "-") {
    text.assign(std::istreambuf_iterator<char>(std::cin), std::istreambuf_iterator<char>());
  } else {
    auto read = read_text_file(opts.request_path);
    if (!read.ok()) fail(read.error().to_string());
    text = std::move(read).value();
  }
  // ordered_json keeps the request's key order, which tojson reproduces.
  nlohmann::ordered_json request;
  try {
    request = nlohmann::ordered_json::parse(text);
  } catch (const nlohmann::json::exception& e) {  // says where and what (bad UTF-8, a comma)
    fail(opts.request_path + ": not valid JSON: " + e.what());
  }

  auto chat_template = ChatTemplate::load(opts.model_dir);
  if (!chat_template.ok()) fail(chat_template.error().to_string());
  auto prompt = chat_template->render(request);
  if (!prompt.ok()) fail(prompt.error().to_string());

  const std::string& out = prompt.value();
  if (std::fwrite(out.data(), 1, out.size(), stdout) != out.size() || std::fflush(stdout) != 0) {
    fail("cannot write to standard output");
  }
}

}  // namespace

void register_chat_template(CLI::App& app) {
  auto opts = std::make_shared<ChatTemplateOptions>();
  CLI::App* cmd = app.add_subcommand(
      "chat-template", "Print the prompt a chat request renders to with the model's chat template");
  cmd->add_option("--model", opts->model_dir,
                  "Model directory (tokenizer_config.json and/or chat_template.jinja)")
      ->required();
  cmd->add_option("--request", opts->request_path,
                  "JSON file {\"messages\", \"tools\", \"add_generation_prompt\", "
                  "\"chat_template_kwargs\"}; '-' reads standard input")
      ->required();
  cmd->callback([opts] { run_chat_template(*opts); });
}

}  // namespace recur::cli
