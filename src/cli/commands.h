// Each subcommand of build/recur lives in its own file and registers itself here.
#pragma once

#include <CLI/CLI.hpp>

namespace recur::cli {

void register_verify(CLI::App& app);
void register_generate(CLI::App& app);
void register_tokenize(CLI::App& app);
void register_chat_template(CLI::App& app);
void register_serve(CLI::App& app);
void register_bench(CLI::App& app);

// Ends the program with `code` from inside a subcommand callback.
[[noreturn]] inline void exit_with(int code) {
  throw CLI::RuntimeError(code);
}

}  // namespace recur::cli
