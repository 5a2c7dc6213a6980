#pragma once
namespace dtrain {
// dtrain's version string ("major.minor.patch").
const char* version();
}  // namespace dtrain
