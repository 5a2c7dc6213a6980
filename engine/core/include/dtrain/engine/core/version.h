#pragma once
namespace dtrain {
// dtrain's version string ("major.minor.patch").
const char* version();
}  // namespace dtrain

#include "dtrain/dist/glog_compat.h"  // last: keeps glog's LOG macros whatever the include order
