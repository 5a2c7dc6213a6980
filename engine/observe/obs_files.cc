#include "obs_files.h"

#include <sys/stat.h>
#include <sys/types.h>

#include <cerrno>
#include <cstring>

namespace dtrain::engine::obs_detail {
namespace {

// "" when path is an existing directory or was created now.
std::string make_one(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) == 0) {
    return S_ISDIR(st.st_mode) ? "" : "'" + path + "' exists and is not a directory";
  }
  if (::mkdir(path.c_str(), 0777) == 0 || errno == EEXIST) return "";
  return std::string("cannot create '") + path + "': " + std::strerror(errno);
}

}  // namespace

std::string make_directories(const std::string& dir) {
  if (dir.empty()) return "";
  // Every prefix ending before a '/', then the whole path.
  for (size_t pos = dir.find('/', 1); pos != std::string::npos; pos = dir.find('/', pos + 1)) {
    if (dir[pos - 1] == '/') continue;
    if (std::string why = make_one(dir.substr(0, pos)); !why.empty()) return why;
  }
  return make_one(dir);
}

std::string parent_dir(const std::string& path) {
  const size_t slash = path.find_last_of('/');
  if (slash == std::string::npos) return "";
  if (slash == 0) return "/";
  return path.substr(0, slash);
}

std::string join_path(const std::string& a, const std::string& b) {
  if (a.empty()) return b;
  return a.back() == '/' ? a + b : a + "/" + b;
}

}  // namespace dtrain::engine::obs_detail
