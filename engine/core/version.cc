#include "dtrain/engine/core/version.h"

namespace dtrain {
const char* version() { return "0.1.0"; }
}  // namespace dtrain
