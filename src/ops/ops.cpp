#include "ops/ops.h"

namespace recur {}  // The interface has no code of its own.
