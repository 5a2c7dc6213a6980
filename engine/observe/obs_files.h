// File-system helpers of the observability writers, on POSIX calls: libtorch.so exports its
// own copies of std::filesystem's functions, which programs linking it may bind to (its
// remove_all crashes with this libstdc++), so these writers stay off std::filesystem.
#pragma once

#include <string>

namespace dtrain::engine::obs_detail {

// mkdir -p. Returns "" on success, else the reason (strerror, or "not a directory").
std::string make_directories(const std::string& dir);
// The directory part of a path ("" for a bare file name; "/" for "/x").
std::string parent_dir(const std::string& path);
// a + "/" + b, without doubling a trailing slash.
std::string join_path(const std::string& a, const std::string& b);

}  // namespace dtrain::engine::obs_detail
