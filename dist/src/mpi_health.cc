#include "mpi_health.h"

#include <glog/logging.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>

#include "async.h"
#include "dtrain/dist/error.h"
#include "mpi_runtime.h"

namespace dtrain::dist {

// Sent as MPI_BYTE between processes of one build (same layout everywhere).
struct HealthMessage {
  int64_t type = 0;  // kAsk or kReply
  int64_t nonce = 0;
  int64_t owner = -1, counter = -1, kind = 0;  // the CommKey
  int64_t seq = 0;
  int64_t known = 0;  // reply: 1 when the communicator is registered there
  int64_t reached = 0, completed = 0;
  char doing[184] = {};  // reply: Watchdog::oldest_in_flight(), truncated, NUL-terminated
};

namespace {

constexpr int kHealthTag = 0x4841;  // "HA"
constexpr int64_t kAsk = 1;
constexpr int64_t kReply = 2;
constexpr auto kIdlePoll = std::chrono::milliseconds(50);
constexpr auto kBusyPoll = std::chrono::milliseconds(5);
constexpr int kHostLen = 64;

CommKey key_of(const HealthMessage& m) { return CommKey{m.owner, m.counter, m.kind}; }

}  // namespace

struct HealthService::Query {
  int64_t nonce = 0;
  CommKey key;
  uint64_t seq = 0;
  std::vector<int> targets;  // world ranks to ask (every member but this rank)
  bool sent = false;
  std::map<int, HealthMessage> replies;  // by world rank
};

struct HealthService::Pending {
  MPI_Request request = MPI_REQUEST_NULL;
  HealthMessage message;  // the send buffer: must stay put until the send completes
};

// ---- tickets -----------------------------------------------------------------------------

HealthTicket::HealthTicket(std::weak_ptr<HealthService> service, CommKey key,
                           std::vector<int> members, std::shared_ptr<OpProgress> progress)
    : service_(std::move(service)),
      key_(key),
      members_(std::move(members)),
      progress_(std::move(progress)) {}

HealthTicket::~HealthTicket() {
  if (auto service = service_.lock()) service->leave(key_);
}

std::string HealthTicket::arrivals(uint64_t seq, std::chrono::milliseconds window) const {
  auto service = service_.lock();
  return service ? service->arrivals(key_, members_, seq, window) : std::string();
}

std::shared_ptr<HealthTicket> HealthTicket::sibling(int64_t kind) const {
  auto service = service_.lock();
  if (!service) return nullptr;
  CommKey key = key_;
  key.kind = kind;
  return service->join(key, members_, std::make_shared<OpProgress>());
}

// ---- the service -------------------------------------------------------------------------

std::shared_ptr<HealthService> HealthService::start() {
  std::shared_ptr<HealthService> s(new HealthService());
  MPI_CHECK(MPI_Comm_dup(MPI_COMM_WORLD, &s->comm_));
  MPI_CHECK(MPI_Comm_set_errhandler(s->comm_, MPI_ERRORS_RETURN));
  int size = 0;
  MPI_CHECK(MPI_Comm_rank(s->comm_, &s->world_rank_));
  MPI_CHECK(MPI_Comm_size(s->comm_, &size));
  char mine[kHostLen] = {};
  if (gethostname(mine, kHostLen - 1) != 0) std::strncpy(mine, "unknown-host", kHostLen - 1);
  std::vector<char> all(static_cast<size_t>(kHostLen) * size);
  MPI_CHECK(MPI_Allgather(mine, kHostLen, MPI_CHAR, all.data(), kHostLen, MPI_CHAR, s->comm_));
  for (int r = 0; r < size; ++r) {
    const char* h = all.data() + static_cast<size_t>(r) * kHostLen;
    s->hosts_.emplace_back(h, strnlen(h, kHostLen));
  }
  s->sent_to_.assign(size, 0);
  s->received_from_.assign(size, 0);
  s->thread_ = std::thread([raw = s.get()] { raw->loop(); });
  return s;
}

HealthService::~HealthService() {
  // shutdown() joined the thread; if it was never called (MPI is going away without us),
  // stop the thread without further MPI calls.
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  wake_.notify_all();
  if (thread_.joinable()) thread_.join();
}

std::shared_ptr<HealthTicket> HealthService::join(const CommKey& key, std::vector<int> members,
                                                  std::shared_ptr<OpProgress> progress) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    DTRAIN_CHECK(registered_.emplace(key, progress).second, "communicator key (", key.owner, ", ",
                 key.counter, ", ", key.kind, ") registered twice with the health service");
  }
  return std::make_shared<HealthTicket>(weak_from_this(), key, std::move(members),
                                        std::move(progress));
}

void HealthService::leave(const CommKey& key) {
  std::lock_guard<std::mutex> lock(mutex_);
  registered_.erase(key);
}

void HealthService::pause_for_testing(std::chrono::milliseconds duration) {
  std::lock_guard<std::mutex> lock(mutex_);
  paused_until_ = std::chrono::steady_clock::now() + duration;
}

bool pause_health_service_for_testing(std::chrono::milliseconds duration) {
  auto runtime = MpiRuntime::current();
  if (!runtime || !runtime->health()) return false;
  runtime->health()->pause_for_testing(duration);
  return true;
}

std::string HealthService::arrivals(const CommKey& key, const std::vector<int>& members,
                                    uint64_t seq, std::chrono::milliseconds window) {
  auto query = std::make_shared<Query>();
  query->key = key;
  query->seq = seq;
  for (int r : members) {
    if (r != world_rank_) query->targets.push_back(r);
  }
  std::unique_lock<std::mutex> lock(mutex_);
  if (stopping_) return "";
  query->nonce = next_nonce_++;
  queries_.emplace(query->nonce, query);
  wake_.notify_all();
  answered_.wait_for(lock, window,
                     [&] { return stopping_ || query->replies.size() == query->targets.size(); });
  queries_.erase(query->nonce);
  if (stopping_) return "";
  std::vector<PeerArrival> peers;
  for (int r : query->targets) {
    PeerArrival p;
    p.world_rank = r;
    p.host = r < static_cast<int>(hosts_.size()) ? hosts_[r] : "";
    auto it = query->replies.find(r);
    if (it == query->replies.end()) {
      p.state = PeerArrival::State::kNoReply;
    } else {
      const HealthMessage& m = it->second;
      p.reached = static_cast<uint64_t>(m.reached);
      p.completed = static_cast<uint64_t>(m.completed);
      p.doing = std::string(m.doing, strnlen(m.doing, sizeof(m.doing)));
      if (!m.known) {
        p.state = PeerArrival::State::kUnknownComm;
      } else if (p.completed >= seq) {
        p.state = PeerArrival::State::kCompleted;
      } else if (p.reached >= seq) {
        p.state = PeerArrival::State::kWaiting;
      } else {
        p.state = PeerArrival::State::kNotReached;
      }
    }
    peers.push_back(std::move(p));
  }
  lock.unlock();
  return format_arrivals(std::move(peers));
}

void HealthService::loop() {
  for (;;) {
    bool busy = false;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      if (stopping_) return;
      auto now = std::chrono::steady_clock::now();
      if (now < paused_until_) {
        wake_.wait_until(lock, paused_until_, [&] { return stopping_; });
        continue;
      }
      busy = !queries_.empty();
    }
    try {
      send_asks();
      receive_all();
      test_sends();
    } catch (const std::exception& e) {
      // An MPI failure here only costs the stall reports; the collectives have their own.
      LOG(ERROR) << "collective health service stopped: " << e.what();
      std::lock_guard<std::mutex> lock(mutex_);
      stopping_ = true;
      answered_.notify_all();
      return;
    }
    std::unique_lock<std::mutex> lock(mutex_);
    auto unsent = [&] {
      return std::any_of(queries_.begin(), queries_.end(), [](auto& q) { return !q.second->sent; });
    };
    wake_.wait_for(lock, busy ? kBusyPoll : kIdlePoll, [&] { return stopping_ || unsent(); });
  }
}

void HealthService::send_asks() {
  std::vector<std::pair<int, HealthMessage>> asks;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    for (auto& [nonce, q] : queries_) {
      if (q->sent) continue;
      q->sent = true;
      HealthMessage m;
      m.type = kAsk;
      m.nonce = nonce;
      m.owner = q->key.owner;
      m.counter = q->key.counter;
      m.kind = q->key.kind;
      m.seq = static_cast<int64_t>(q->seq);
      for (int r : q->targets) asks.emplace_back(r, m);
    }
  }
  for (auto& [dest, m] : asks) isend(dest, m);
}

void HealthService::receive_all() {
  for (;;) {
    int flag = 0;
    MPI_Message probed = MPI_MESSAGE_NULL;
    MPI_Status status;
    MPI_CHECK(MPI_Improbe(MPI_ANY_SOURCE, kHealthTag, comm_, &flag, &probed, &status));
    if (!flag) return;
    HealthMessage m;
    MPI_CHECK(MPI_Mrecv(&m, sizeof(m), MPI_BYTE, &probed, &status));
    ++received_from_[status.MPI_SOURCE];
    handle(status.MPI_SOURCE, m);
  }
}

void HealthService::handle(int source, const HealthMessage& m) {
  if (m.type == kAsk) {
    HealthMessage reply = m;
    reply.type = kReply;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto it = registered_.find(key_of(m));
      reply.known = it != registered_.end();
      if (reply.known) {
        // completed first: a peer seeing completed >= reached must not read "still running".
        reply.completed = static_cast<int64_t>(it->second->completed.load());
        reply.reached = static_cast<int64_t>(it->second->reached.load());
      }
    }
    std::string doing = Watchdog::instance().oldest_in_flight();
    std::strncpy(reply.doing, doing.c_str(), sizeof(reply.doing) - 1);
    isend(source, reply);
    return;
  }
  if (m.type != kReply) return;
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = queries_.find(m.nonce);
  if (it == queries_.end()) return;  // a late reply to a query that gave up
  Query& q = *it->second;
  if (!(key_of(m) == q.key) || static_cast<uint64_t>(m.seq) != q.seq) return;
  q.replies[source] = m;
  if (q.replies.size() == q.targets.size()) answered_.notify_all();
}

void HealthService::isend(int dest, const HealthMessage& message) {
  auto pending = std::make_unique<Pending>();
  pending->message = message;
  int rc = MPI_Isend(&pending->message, sizeof(HealthMessage), MPI_BYTE, dest, kHealthTag, comm_,
                     &pending->request);
  if (rc != MPI_SUCCESS) {
    // A peer that cannot be reached simply does not answer; the others still can.
    LOG_FIRST_N(WARNING, 1) << "collective health service: cannot send to rank " << dest << ": "
                            << mpi_error_string(rc);
    return;
  }
  ++sent_to_[dest];
  sends_.push_back(std::move(pending));
}

void HealthService::test_sends() {
  for (auto it = sends_.begin(); it != sends_.end();) {
    int done = 0;
    MPI_CHECK(MPI_Test(&(*it)->request, &done, MPI_STATUS_IGNORE));
    it = done ? sends_.erase(it) : it + 1;
  }
}

bool HealthService::shutdown(std::chrono::milliseconds deadline) {
  if (shut_down_) return true;
  shut_down_ = true;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  wake_.notify_all();
  answered_.notify_all();
  if (thread_.joinable()) thread_.join();
  try {
    // How many messages each rank sent to this one; receive those not yet received.
    // Non-blocking, so a rank leaving alone (on an error of its own) does not wait forever
    // for peers that are not finishing.
    std::vector<int64_t> expected(sent_to_.size(), 0);
    MPI_Request exchange = MPI_REQUEST_NULL;
    MPI_CHECK(MPI_Ialltoall(sent_to_.data(), 1, MPI_INT64_T, expected.data(), 1, MPI_INT64_T,
                            comm_, &exchange));
    const bool bounded = deadline != std::chrono::milliseconds::max();
    const auto give_up = std::chrono::steady_clock::now() + (bounded ? deadline : deadline.zero());
    for (int done = 0;;) {
      MPI_CHECK(MPI_Test(&exchange, &done, MPI_STATUS_IGNORE));
      if (done) break;
      if (bounded && std::chrono::steady_clock::now() >= give_up) {
        LOG(WARNING) << "collective health service: the other ranks did not shut down with this "
                        "one within "
                     << deadline.count() / 1000.0 << " s; leaving without waiting for them";
        return false;  // the request and the communicator are left to the process's exit
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
    int64_t stray = 0;
    for (size_t r = 0; r < expected.size(); ++r) {
      for (; received_from_[r] < expected[r]; ++received_from_[r], ++stray) {
        HealthMessage m;
        MPI_CHECK(MPI_Recv(&m, sizeof(m), MPI_BYTE, static_cast<int>(r), kHealthTag, comm_,
                           MPI_STATUS_IGNORE));
      }
    }
    for (auto& pending : sends_) MPI_CHECK(MPI_Wait(&pending->request, MPI_STATUS_IGNORE));
    sends_.clear();
    MPI_CHECK(MPI_Comm_free(&comm_));
    VLOG(1) << "collective health service: drained " << stray << " unanswered messages";
  } catch (const std::exception& e) {
    LOG(ERROR) << "collective health service did not shut down cleanly: " << e.what();
  }
  return true;
}

}  // namespace dtrain::dist
