// Process start-up for dtrain programs: glog with a rank prefix, and the identity used in
// error messages.
#pragma once

#include "dtrain/dist/world.h"

namespace dtrain::dist {

// Initializes glog (once per process) so that every line starts with "[r<rank>] " and sets
// the identity that error messages carry. Logs go to stderr. Safe to call again after the
// world changes (only the prefix is updated).
void init_logging(const char* argv0, const World& world);

}  // namespace dtrain::dist

#include "dtrain/dist/glog_compat.h"  // last: keeps glog's LOG macros whatever the include order
