#include "dtrain/dist/communicator.h"

#include <cstdlib>
#include <algorithm>
#include <atomic>
#include <map>
#include <sstream>
#include <thread>

#include <ATen/ATen.h>
#include <glog/logging.h>

#include "async.h"
#include "dtrain/dist/error.h"

namespace dtrain::dist {

const char* to_string(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return "sum";
    case ReduceOp::kAvg: return "avg";
    case ReduceOp::kMax: return "max";
    case ReduceOp::kMin: return "min";
  }
  return "?";
}

const char* to_string(OpType type) {
  switch (type) {
    case OpType::kAllReduce: return "all_reduce";
    case OpType::kBroadcast: return "broadcast";
    case OpType::kAllGather: return "all_gather";
    case OpType::kReduceScatter: return "reduce_scatter";
    case OpType::kBarrier: return "barrier";
    case OpType::kReduce: return "reduce";
    case OpType::kSend: return "send";
    case OpType::kRecv: return "recv";
  }
  return "?";
}

namespace {

bool supported_dtype(at::ScalarType t) {
  switch (t) {
    case at::kFloat: case at::kDouble: case at::kHalf: case at::kBFloat16:
    case at::kLong: case at::kInt: case at::kByte: case at::kChar: case at::kBool:
      return true;
    default:
      return false;
  }
}

void check_tensor(const Communicator& comm, const char* op, const char* role, const at::Tensor& t) {
  DTRAIN_CHECK(t.defined(), comm.name(), ".", op, ": the ", role, " tensor is undefined");
  DTRAIN_CHECK(t.is_contiguous(), comm.name(), ".", op, ": the ", role, " tensor ", t.sizes(),
               " is not contiguous; pass tensor.contiguous()");
  DTRAIN_CHECK(supported_dtype(t.scalar_type()), comm.name(), ".", op, ": dtype ",
               t.scalar_type(), " of the ", role,
               " tensor is not supported (float32, float64, float16, bfloat16, int64, int32, "
               "uint8, int8, bool are)");
  DTRAIN_CHECK(comm.supports(t.device().type()), comm.name(), ".", op, ": backend '",
               comm.backend(), "' does not run collectives on ", t.device(), " tensors",
               t.is_cuda() ? "; use the nccl or mpi backend" : "; use the mpi backend");
}

void check_pair(const Communicator& comm, const char* op, const at::Tensor& in, const at::Tensor& out) {
  DTRAIN_CHECK(in.scalar_type() == out.scalar_type(), comm.name(), ".", op,
               ": input dtype ", in.scalar_type(), " differs from output dtype ", out.scalar_type());
  DTRAIN_CHECK(in.device() == out.device(), comm.name(), ".", op, ": input on ", in.device(),
               " but output on ", out.device());
}

// An all_gather's input (a reduce_scatter's output) may share memory with the whole buffer only
// as this rank's own slice of it, the one in-place form NCCL and MPI define; any other overlap
// gives undefined, silently wrong data.
void check_rank_slice(const Communicator& comm, const char* op, const char* part_name, const at::Tensor& part,
                      const at::Tensor& whole) {
  const auto* p = static_cast<const char*>(part.data_ptr());
  const auto* w = static_cast<const char*>(whole.data_ptr());
  const int64_t pn = static_cast<int64_t>(part.nbytes()), wn = static_cast<int64_t>(whole.nbytes());
  if (pn == 0 || wn == 0 || p >= w + wn || w >= p + pn) return;  // apart
  DTRAIN_CHECK(p == w + comm.rank() * pn, comm.name(), ".", op, ": the ", part_name,
               " overlaps the other buffer but is not this rank's slice of it (rank ", comm.rank(), ": elements [",
               comm.rank() * part.numel(), ", ", (comm.rank() + 1) * part.numel(), ")); pass that slice for an "
               "in-place operation, or separate buffers");
}

void check_reduce(const Communicator& comm, const char* op, ReduceOp r, const at::Tensor& t) {
  DTRAIN_CHECK(r != ReduceOp::kAvg || at::isFloatingType(t.scalar_type()), comm.name(), ".", op,
               ": avg needs a floating-point tensor, got ", t.scalar_type(),
               "; reduce with sum and divide yourself");
  DTRAIN_CHECK(t.scalar_type() != at::kBool || r == ReduceOp::kMax || r == ReduceOp::kMin,
               comm.name(), ".", op, ": bool tensors reduce only with max (any) or min (all)");
}

bool env_flag(const char* name) {
  const char* v = std::getenv(name);
  return v && *v && std::string(v) != "0";
}

// Fixed-length descriptor of an operation, compared across ranks in debug mode.
constexpr int kDescLen = 16;
constexpr int kMaxDims = 8;

std::vector<int64_t> descriptor(OpType type, const at::Tensor& in, const at::Tensor& out,
                                ReduceOp reduce, int root, uint64_t seq) {
  std::vector<int64_t> d(kDescLen, -1);
  d[0] = static_cast<int64_t>(seq);
  d[1] = static_cast<int64_t>(type);
  d[2] = in.defined() ? static_cast<int64_t>(in.scalar_type()) : -1;
  d[3] = static_cast<int64_t>(reduce);
  d[4] = root;
  d[5] = out.defined() ? out.numel() : -1;
  d[6] = in.defined() ? in.dim() : -1;
  if (in.defined()) {
    for (int i = 0; i < std::min<int64_t>(in.dim(), kMaxDims); ++i) d[7 + i] = in.size(i);
  }
  return d;
}

std::string describe_descriptor(const std::vector<int64_t>& d) {
  std::ostringstream os;
  os << to_string(static_cast<OpType>(d[1]));
  if (d[2] >= 0) {
    os << "(" << static_cast<at::ScalarType>(d[2]) << "[";
    for (int64_t i = 0; i < std::min<int64_t>(d[6], kMaxDims); ++i) os << (i ? "," : "") << d[7 + i];
    os << "]";
    auto type = static_cast<OpType>(d[1]);
    if (type == OpType::kAllReduce || type == OpType::kReduceScatter || type == OpType::kReduce)
      os << ", " << to_string(static_cast<ReduceOp>(d[3]));
    if (type == OpType::kBroadcast || type == OpType::kReduce) os << ", root " << d[4];
    if (type != OpType::kBroadcast) os << ", output numel " << d[5];
    os << ")";
  }
  os << " as its #" << d[0];
  return os.str();
}

}  // namespace

// A group's thread ownership: the thread that began the group holds `mutex` until its
// end_group(); every other thread's operation takes `mutex` while it issues (GroupTurn), so it
// waits for the group to end and never joins it.
struct Communicator::GroupGate {
  std::mutex mutex;
  std::atomic<std::thread::id> owner{};  // the open group's thread; none when no group is open

  bool mine() const { return owner.load() == std::this_thread::get_id(); }
};

namespace {

// For one operation's issue: nothing on the thread whose group is open (it holds the gate),
// else the gate for the duration, which waits while another thread's group is open.
class GroupTurn {
 public:
  GroupTurn(std::mutex& mutex, bool own_group) {
    if (!own_group) lock_ = std::unique_lock<std::mutex>(mutex);
  }

 private:
  std::unique_lock<std::mutex> lock_;
};

}  // namespace

Communicator::Communicator(int rank, int size, CommOptions options)
    : rank_(rank), size_(size), options_(std::move(options)),
      sends_(static_cast<size_t>(std::max(size, 0)), 0), recvs_(static_cast<size_t>(std::max(size, 0)), 0),
      submit_mutex_(std::make_unique<std::mutex>()), group_(std::make_unique<GroupGate>()) {
  if (env_flag("DTRAIN_DEBUG_COLLECTIVES")) options_.debug_collectives = true;
  DTRAIN_CHECK(options_.timeout.count() > 0, "collective timeout must be positive, got ",
               options_.timeout.count(), " ms; pass --collective_timeout_s > 0");
}

Communicator::~Communicator() {
  if (group_->mine()) {  // a begin_group() without its end_group(): let other threads' operations go
    LOG(ERROR) << "'" << name() << "' destroyed inside a group of operations (begin_group() without end_group())";
    group_->owner = std::thread::id();
    group_->mutex.unlock();
  }
}

namespace {

class CompletedWork final : public Work {
 public:
  explicit CompletedWork(uint64_t seq) : seq_(seq) {}
  void wait() override {}
  void synchronize() override {}
  bool is_completed() override { return true; }
  uint64_t sequence() const override { return seq_; }

 private:
  const uint64_t seq_;
};

}  // namespace

WorkPtr completed_work(uint64_t seq) { return std::make_shared<CompletedWork>(seq); }

void Communicator::begin_group() {
  DTRAIN_CHECK(!group_->mine(), "'", name(), "': begin_group() inside a group; groups do not nest");
  group_->mutex.lock();  // waits while another thread's group is open
  group_->owner = std::this_thread::get_id();
  try {
    do_begin_group();
  } catch (...) {
    group_->owner = std::thread::id();
    group_->mutex.unlock();
    throw;
  }
}

void Communicator::end_group() {
  DTRAIN_CHECK(group_->mine(), "'", name(), "': end_group() on a thread that has no group open on this "
               "communicator; a group ends on the thread that began it (CommGroup pairs the calls)");
  // The group ends (and other threads may issue again) whether or not its launch succeeded.
  struct Release {
    GroupGate& gate;
    ~Release() {
      gate.owner = std::thread::id();
      gate.mutex.unlock();
    }
  } release{*group_};
  do_end_group();
}

WorkPtr Communicator::submit(Op op) {
  GroupTurn turn(group_->mutex, group_->mine());
  std::lock_guard<std::mutex> lock(*submit_mutex_);
  op.seq = ++seq_;
  if (size_ > 1 && op.type != OpType::kBarrier) {
    const at::Tensor& counted = op.type == OpType::kAllGather ? op.output : op.input.defined() ? op.input : op.output;
    const double bytes = static_cast<double>(counted.numel()) * static_cast<double>(counted.element_size());
    const double share = static_cast<double>(size_ - 1) / size_;
    double bus = bytes;  // broadcast, reduce
    if (op.type == OpType::kAllReduce) bus = 2 * share * bytes;
    if (op.type == OpType::kAllGather || op.type == OpType::kReduceScatter) bus = share * bytes;
    ++traffic_.ops;
    traffic_.payload_bytes += bytes;
    traffic_.bus_bytes += bus;
  }
  if (options_.debug_collectives && size_ > 1) check_matching(op);
  return enqueue(std::move(op));
}

CommTraffic Communicator::traffic() const {
  std::lock_guard<std::mutex> lock(*submit_mutex_);
  return traffic_;
}

void Communicator::check_matching(const Op& op) {
  std::vector<int64_t> mine = descriptor(op.type, op.input, op.output, op.reduce, op.root, op.seq);
  std::vector<int64_t> all = exchange(mine);
  DTRAIN_CHECK(all.size() == static_cast<size_t>(kDescLen * size_), "debug exchange returned ",
               all.size(), " values");
  // Group ranks by what they called, groups ordered by their lowest rank.
  std::vector<std::pair<std::vector<int64_t>, std::vector<int>>> groups;
  for (int r = 0; r < size_; ++r) {
    std::vector<int64_t> d(all.begin() + r * kDescLen, all.begin() + (r + 1) * kDescLen);
    auto it = std::find_if(groups.begin(), groups.end(), [&](auto& g) { return g.first == d; });
    if (it == groups.end()) {
      groups.push_back({d, {r}});
    } else {
      it->second.push_back(r);
    }
  }
  if (groups.size() == 1) return;
  std::ostringstream os;
  os << "collective mismatch on '" << name() << "' (DTRAIN_DEBUG_COLLECTIVES): ";
  bool first = true;
  for (auto& [d, ranks] : groups) {
    os << (first ? "" : "; ") << (ranks.size() > 1 ? "ranks " : "rank ");
    for (size_t i = 0; i < ranks.size(); ++i) os << (i ? "," : "") << ranks[i];
    os << " called " << describe_descriptor(d);
    first = false;
  }
  os << ". Every rank must issue the same collectives, with the same shapes, in the same order.";
  throw Error(os.str());
}

WorkPtr Communicator::all_reduce(const at::Tensor& tensor, ReduceOp op) {
  check_tensor(*this, "all_reduce", "", tensor);
  check_reduce(*this, "all_reduce", op, tensor);
  return submit(Op{OpType::kAllReduce, tensor, tensor, op, 0, 0});
}

WorkPtr Communicator::all_reduce(const at::Tensor& input, const at::Tensor& output, ReduceOp op) {
  check_tensor(*this, "all_reduce", "input", input);
  check_tensor(*this, "all_reduce", "output", output);
  check_pair(*this, "all_reduce", input, output);
  DTRAIN_CHECK(input.numel() == output.numel(), name(), ".all_reduce: input has ", input.numel(),
               " elements but output has ", output.numel());
  check_reduce(*this, "all_reduce", op, input);
  return submit(Op{OpType::kAllReduce, input, output, op, 0, 0});
}

WorkPtr Communicator::broadcast(const at::Tensor& tensor, int root) {
  check_tensor(*this, "broadcast", "", tensor);
  DTRAIN_CHECK(root >= 0 && root < size_, name(), ".broadcast: root ", root,
               " is not a rank of this communicator (size ", size_, ")");
  return submit(Op{OpType::kBroadcast, tensor, tensor, ReduceOp::kSum, root, 0});
}

WorkPtr Communicator::reduce(const at::Tensor& tensor, int root, ReduceOp op) {
  check_tensor(*this, "reduce", "", tensor);
  check_reduce(*this, "reduce", op, tensor);
  DTRAIN_CHECK(root >= 0 && root < size_, name(), ".reduce: root ", root,
               " is not a rank of this communicator (size ", size_, ")");
  return submit(Op{OpType::kReduce, tensor, tensor, op, root, 0});
}

WorkPtr Communicator::send(const at::Tensor& tensor, int peer) { return submit_p2p(OpType::kSend, tensor, peer); }

WorkPtr Communicator::recv(const at::Tensor& tensor, int peer) { return submit_p2p(OpType::kRecv, tensor, peer); }

WorkPtr Communicator::submit_p2p(OpType type, const at::Tensor& tensor, int peer) {
  const char* op = to_string(type);
  check_tensor(*this, op, "", tensor);
  DTRAIN_CHECK(peer >= 0 && peer < size_, name(), ".", op, ": peer ", peer, " is not a rank of this communicator (size ",
               size_, ")");
  P2pOp p2p{type, tensor, peer, 0};
  GroupTurn turn(group_->mutex, group_->mine());
  {
    std::lock_guard<std::mutex> lock(*submit_mutex_);
    p2p.seq = ++(type == OpType::kSend ? sends_ : recvs_)[static_cast<size_t>(peer)];
    if (type == OpType::kSend && size_ > 1) {
      const double bytes = static_cast<double>(tensor.numel()) * static_cast<double>(tensor.element_size());
      ++traffic_.ops;
      traffic_.payload_bytes += bytes;
      traffic_.bus_bytes += bytes;
    }
  }
  return enqueue_p2p(std::move(p2p));
}

WorkPtr Communicator::enqueue_p2p(P2pOp op) {
  throw Error(name() + "." + to_string(op.type) + ": backend '" + backend() +
              "' has no point-to-point operations; use the mpi, nccl or local backend");
}

WorkPtr Communicator::all_gather(const at::Tensor& input, const at::Tensor& output) {
  check_tensor(*this, "all_gather", "input", input);
  check_tensor(*this, "all_gather", "output", output);
  check_pair(*this, "all_gather", input, output);
  DTRAIN_CHECK(output.numel() == input.numel() * size_, name(), ".all_gather: output has ",
               output.numel(), " elements; it needs size() x input = ", size_, " x ",
               input.numel(), " = ", input.numel() * size_);
  check_rank_slice(*this, "all_gather", "input", input, output);
  return submit(Op{OpType::kAllGather, input, output, ReduceOp::kSum, 0, 0});
}

std::vector<int64_t> all_gather_counts(Communicator& comm, int64_t mine, c10::Device device) {
  const auto options = at::TensorOptions().dtype(at::kLong).device(device);
  at::Tensor all = at::empty({comm.size()}, options);
  comm.all_gather(at::full({1}, mine, options), all)->wait();
  const at::Tensor host = all.cpu();
  return std::vector<int64_t>(host.data_ptr<int64_t>(), host.data_ptr<int64_t>() + comm.size());
}

at::Tensor all_gather_rows(Communicator& comm, const at::Tensor& rows, const std::vector<int64_t>& counts) {
  DTRAIN_CHECK(rows.defined() && rows.dim() >= 1, comm.name(), ".all_gather_rows: needs rows [n, ...], got ",
               rows.defined() ? rows.sizes() : at::IntArrayRef{});
  const int n = comm.size();
  DTRAIN_CHECK(static_cast<int>(counts.size()) == n && counts[comm.rank()] == rows.size(0), comm.name(),
               ".all_gather_rows: counts must hold every rank's row count (this rank's: ", rows.size(0), ")");
  const int64_t most = *std::max_element(counts.begin(), counts.end());
  std::vector<int64_t> shape = rows.sizes().vec();
  shape[0] = most;
  at::Tensor padded = rows.size(0) == most ? rows.contiguous() : at::zeros(shape, rows.options());
  if (rows.size(0) != most && rows.size(0) > 0) padded.narrow(0, 0, rows.size(0)).copy_(rows);
  shape[0] = most * n;
  at::Tensor gathered = at::empty(shape, rows.options());
  if (most > 0) comm.all_gather(padded, gathered)->wait();
  std::vector<at::Tensor> parts;
  for (int r = 0; r < n; ++r) parts.push_back(gathered.narrow(0, r * most, counts[r]));
  return at::cat(parts);
}

at::Tensor all_gather_rows(Communicator& comm, const at::Tensor& rows, std::vector<int64_t>* counts) {
  DTRAIN_CHECK(rows.defined() && rows.dim() >= 1, comm.name(), ".all_gather_rows: needs rows [n, ...], got ",
               rows.defined() ? rows.sizes() : at::IntArrayRef{});
  const std::vector<int64_t> sizes = all_gather_counts(comm, rows.size(0), rows.device());
  if (counts) *counts = sizes;
  return all_gather_rows(comm, rows, sizes);
}

WorkPtr Communicator::reduce_scatter(const at::Tensor& input, const at::Tensor& output, ReduceOp op) {
  check_tensor(*this, "reduce_scatter", "input", input);
  check_tensor(*this, "reduce_scatter", "output", output);
  check_pair(*this, "reduce_scatter", input, output);
  check_reduce(*this, "reduce_scatter", op, input);
  DTRAIN_CHECK(input.numel() == output.numel() * size_, name(), ".reduce_scatter: input has ",
               input.numel(), " elements; it needs size() x output = ", size_, " x ",
               output.numel(), " = ", output.numel() * size_);
  check_rank_slice(*this, "reduce_scatter", "output", output, input);
  return submit(Op{OpType::kReduceScatter, input, output, op, 0, 0});
}

WorkPtr Communicator::barrier() {
  return submit(Op{OpType::kBarrier, at::Tensor(), at::Tensor(), ReduceOp::kSum, 0, 0});
}

std::unique_ptr<Communicator> Communicator::split(int color, int key, const std::string& suffix) {
  return split_as(color, key, suffix, /*host_only=*/false);
}

std::unique_ptr<Communicator> Communicator::split_host(int color, int key, const std::string& suffix) {
  return split_as(color, key, suffix, /*host_only=*/true);
}

std::unique_ptr<Communicator> Communicator::split_as(int color, int key, const std::string& suffix, bool host_only) {
  CommOptions child = options_;
  child.name = options_.name + "/" + suffix;
  GroupTurn turn(group_->mutex, group_->mine());
  std::lock_guard<std::mutex> lock(*submit_mutex_);
  // Every member must arrive (MPI_Comm_split, ncclCommSplit, the health service's registration)
  // and nothing interrupts the wait: bounded like a collective, so a peer that died between
  // start-up and the split ends the job with the timeout message instead of hanging the rest.
  WatchedCall bounded(detail::concat("split of '", name(), "' into '", child.name, "' (", backend(), ", rank ", rank_,
                                     "/", size_, ")"),
                      options_.timeout);
  return host_only ? do_split_host(color, key, std::move(child)) : do_split(color, key, std::move(child));
}

CommGroup::~CommGroup() {
  if (!comm_) return;
  try {
    close();
  } catch (const std::exception& e) {
    LOG(ERROR) << "closing a group of collectives on '" << comm_->name() << "' failed: " << e.what();
  }
}

void CommGroup::close() {
  Communicator* comm = comm_;
  comm_ = nullptr;
  if (comm) comm->end_group();
}

}  // namespace dtrain::dist
