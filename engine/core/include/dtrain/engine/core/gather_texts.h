// Every rank's text on every rank: the collective behind agreeing on settings, on the ranks'
// failures and on a pipeline's per-stage records (a checkpoint's layout).
#pragma once

#include <string>
#include <vector>

#include "dtrain/dist/communicator.h"

namespace dtrain::engine {

// Collective over comm: every rank's text, in rank order, on every rank (e.g. each rank's
// error, so that every rank can fail with the same message). Two all-gathers (the lengths,
// then the bytes); a single-process communicator returns at once.
std::vector<std::string> gather_texts(dist::Communicator& comm, const std::string& mine);

}  // namespace dtrain::engine
