// `recur serve`: placeholder until the HTTP server lands.
#include "cli/commands.h"

namespace recur::cli {
void register_serve(CLI::App& app) { (void)app; }
}  // namespace recur::cli
