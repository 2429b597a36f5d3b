#include "cli/commands.h"
namespace recur::cli {
void register_verify(CLI::App& app) { (void)app; }
void register_generate(CLI::App& app) { (void)app; }
}  // namespace recur::cli
