#include "health.h"

#include <algorithm>
#include <sstream>

namespace dtrain::dist {
namespace {

using State = PeerArrival::State;

bool not_arrived(State s) {
  return s == State::kNoReply || s == State::kUnknownComm || s == State::kNotReached;
}

// "rank 3 (host a)" or "ranks 2,3 (host a), 5 (host b)": ranks of one host grouped while
// they are consecutive in `peers` (sorted by rank).
std::string rank_list(const std::vector<const PeerArrival*>& peers) {
  std::ostringstream os;
  os << (peers.size() == 1 ? "rank " : "ranks ");
  for (size_t i = 0; i < peers.size(); ++i) {
    os << peers[i]->world_rank;
    bool last_of_host = i + 1 == peers.size() || peers[i + 1]->host != peers[i]->host;
    if (!last_of_host) {
      os << ",";
      continue;
    }
    if (!peers[i]->host.empty()) os << " (host " << peers[i]->host << ")";
    if (i + 1 < peers.size()) os << ", ";
  }
  return os.str();
}

std::string why_not_arrived(const PeerArrival& p) {
  std::ostringstream os;
  os << "rank " << p.world_rank << ": ";
  switch (p.state) {
    case State::kNoReply:
      os << "no reply - stopped, dead or unreachable";
      break;
    case State::kUnknownComm:
      os << "has no such communicator (not created yet, or destroyed)";
      break;
    default:
      if (p.reached > p.completed) {
        os << "still in #" << p.reached << " on this communicator";
      } else {
        os << (p.completed ? "done with #" + std::to_string(p.completed) : "no operation yet");
        os << (p.doing.empty() ? ", not in any collective" : ", waiting in " + p.doing);
      }
  }
  return os.str();
}

}  // namespace

void OpProgress::complete(uint64_t seq) {
  uint64_t seen = completed.load();
  while (seen < seq && !completed.compare_exchange_weak(seen, seq)) {
  }
}

std::chrono::milliseconds arrival_window(std::chrono::milliseconds timeout) {
  return std::max(std::chrono::milliseconds(100),
                  std::min<std::chrono::milliseconds>(std::chrono::seconds(5), timeout / 4));
}

std::string format_arrivals(std::vector<PeerArrival> peers) {
  std::sort(peers.begin(), peers.end(),
            [](const PeerArrival& a, const PeerArrival& b) { return a.world_rank < b.world_rank; });
  std::vector<const PeerArrival*> missing, waiting, completed;
  for (const PeerArrival& p : peers) {
    if (not_arrived(p.state)) {
      missing.push_back(&p);
    } else if (p.state == State::kWaiting) {
      waiting.push_back(&p);
    } else {
      completed.push_back(&p);
    }
  }
  std::vector<std::string> parts;
  if (!missing.empty()) {
    std::ostringstream os;
    os << rank_list(missing) << (missing.size() == 1 ? " has" : " have") << " not reached it (";
    for (size_t i = 0; i < missing.size(); ++i)
      os << (i ? "; " : "") << why_not_arrived(*missing[i]);
    os << ")";
    parts.push_back(os.str());
  } else if (!peers.empty()) {
    parts.push_back("every other rank has reached it");
  }
  if (!waiting.empty()) {
    parts.push_back(rank_list(waiting) + (waiting.size() == 1 ? " is" : " are") +
                    " waiting in it too");
  }
  if (!completed.empty()) {
    // Not necessarily a mismatch: in some algorithms a rank has its result before a peer has
    // received everything it needs.
    parts.push_back(rank_list(completed) + (completed.size() == 1 ? " has" : " have") +
                    " already completed it");
  }
  std::string text;
  for (size_t i = 0; i < parts.size(); ++i) text += (i ? "; " : "") + parts[i];
  return text;
}

}  // namespace dtrain::dist
