#include "dtrain/engine/train/agreement.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <map>
#include <sstream>

#include "dtrain/dist/error.h"
#include "dtrain/engine/core/crc32c.h"

namespace dtrain::engine {
namespace {

constexpr char kFieldEnd = '\x1f';
constexpr char kEntryEnd = '\x1e';

std::string encode(Settings settings) {
  std::sort(settings.begin(), settings.end());
  std::string text;
  for (const auto& [name, value] : settings) text += name + kFieldEnd + value + kEntryEnd;
  return text;
}

std::map<std::string, std::string> decode(const std::string& text) {
  std::map<std::string, std::string> out;
  size_t at = 0;
  while (at < text.size()) {
    const size_t field = text.find(kFieldEnd, at), end = text.find(kEntryEnd, at);
    if (field == std::string::npos || end == std::string::npos || field > end) break;
    out[text.substr(at, field - at)] = text.substr(field + 1, end - field - 1);
    at = end + 1;
  }
  return out;
}

// "rank 0 has 8, ranks 1-3 has 16": ranks grouped by value, in rank order of first appearance.
std::string describe(const std::vector<std::string>& values) {
  std::vector<std::pair<std::string, std::vector<int>>> groups;
  for (int r = 0; r < static_cast<int>(values.size()); ++r) {
    auto it = std::find_if(groups.begin(), groups.end(), [&](const auto& g) { return g.first == values[r]; });
    if (it == groups.end()) {
      groups.push_back({values[r], {r}});
    } else {
      it->second.push_back(r);
    }
  }
  std::ostringstream os;
  for (size_t g = 0; g < groups.size(); ++g) {
    const std::vector<int>& ranks = groups[g].second;
    os << (g ? ", " : "") << (ranks.size() > 1 ? "ranks " : "rank ");
    for (size_t k = 0; k < ranks.size() && k < 8; ++k) os << (k ? "," : "") << ranks[k];
    if (ranks.size() > 8) os << ",... (" << ranks.size() << " ranks)";
    os << " " << (ranks.size() > 1 ? "have " : "has ") << groups[g].first;
  }
  return os.str();
}

}  // namespace

void agree_on_settings(dist::Communicator& comm, const Settings& settings, const std::string& what) {
  if (comm.size() == 1) return;
  const std::string text = encode(settings);
  const int64_t fingerprint =
      (static_cast<int64_t>(text.size()) << 32) | crc32c(text.data(), text.size());
  at::Tensor bounds = at::tensor({fingerprint, -fingerprint}, at::kLong);
  comm.all_reduce(bounds, dist::ReduceOp::kMax)->wait();
  if (bounds[0].item<int64_t>() == -bounds[1].item<int64_t>()) return;  // the same everywhere
  // They differ: every rank gathers every rank's text and names the differences.
  std::vector<std::map<std::string, std::string>> by_rank;
  std::vector<std::string> names;  // every name, sorted
  for (const std::string& theirs : gather_texts(comm, text)) {
    by_rank.push_back(decode(theirs));
    for (const auto& [name, value] : by_rank.back()) names.push_back(name);
  }
  std::sort(names.begin(), names.end());
  names.erase(std::unique(names.begin(), names.end()), names.end());
  std::ostringstream message;
  message << "the ranks were started with different settings (" << what << "); every rank must get the same:";
  for (const std::string& name : names) {
    std::vector<std::string> values;
    for (const auto& ranks : by_rank) {
      auto it = ranks.find(name);
      values.push_back(it == ranks.end() ? "(not set)" : it->second);
    }
    if (std::all_of(values.begin(), values.end(), [&](const std::string& v) { return v == values[0]; })) continue;
    message << "\n  " << name << ": " << describe(values);
  }
  throw Error(message.str());
}

}  // namespace dtrain::engine
