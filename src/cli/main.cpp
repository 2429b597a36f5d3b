// build/recur: the command-line program. Subcommands are registered from their own files.
#include <cstdio>
#include <exception>

#include "cli/commands.h"

int main(int argc, char** argv) {
  CLI::App app{"recur: inference engine for hybrid linear-attention language models"};
  app.require_subcommand(1);
  app.set_version_flag("--version", RECUR_VERSION);
  // Help shows each option's default (subcommands take the parent's option defaults).
  app.option_defaults()->always_capture_default();
  recur::cli::register_verify(app);
  recur::cli::register_generate(app);
  recur::cli::register_tokenize(app);
  recur::cli::register_chat_template(app);
  recur::cli::register_serve(app);
  recur::cli::register_bench(app);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  } catch (const std::exception& e) {  // resources the system refused (memory, threads)
    std::fprintf(stderr, "error: %s\n", e.what());
    return 2;
  }
  return 0;
}
