// Settings every rank of a job must share, checked once at start-up: ranks launched with
// different flags (per-rank argument lists, per-host wrapper scripts, defaults derived from
// each node) would otherwise average gradients of different batches, or hang when one rank
// finishes first.
#pragma once

#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "dtrain/dist/communicator.h"
#include "dtrain/engine/core/gather_texts.h"  // gather_texts(), which agree_on_settings uses

namespace dtrain::engine {

// name -> value, as text. Names are unique; the order does not matter.
using Settings = std::vector<std::pair<std::string, std::string>>;

// A setting's value as text, numbers with 17 significant digits (two doubles that differ
// compare different).
template <typename T>
std::string setting_text(const T& value) {
  std::ostringstream os;
  os.precision(17);
  os << value;
  return os.str();
}

// Collective over comm (every rank calls it with its own settings). When they agree it costs
// one all-reduce of two integers. When any differ, every rank throws dtrain::Error with the
// same message: `what`, then each differing setting with its value on each rank ("batch_size:
// rank 0 has 8, rank 1 has 16"); a setting some ranks lack shows as "(not set)" there. A
// single-process communicator returns at once.
void agree_on_settings(dist::Communicator& comm, const Settings& settings, const std::string& what);

}  // namespace dtrain::engine

#include "dtrain/dist/glog_compat.h"  // last: keeps glog's LOG macros whatever the include order
