// Every collective of the MPI backend, for every dtype, in and out of place, at sizes 0, 1,
// odd and 1M elements (4-8 MiB messages: past Open MPI's eager limits, so its rendezvous and
// pipelined paths), on the world and on sub-groups, against closed-form results.
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include "comm_contract_cases.h"
#include "dtrain/dist/communicator.h"
#include "dtrain/dist/error.h"
#include "dtrain/dist/mesh.h"
#include "test_util.h"

namespace dtrain::dist {
namespace {

using testing_util::world_comm;

const std::vector<at::ScalarType> kAllTypes = {at::kFloat, at::kDouble, at::kHalf, at::kBFloat16,
                                               at::kLong, at::kInt, at::kByte};
const std::vector<at::ScalarType> kLargeTypes = {at::kFloat, at::kDouble, at::kHalf,
                                                 at::kBFloat16, at::kLong};
constexpr int64_t kLarge = int64_t{1} << 20;

std::vector<int64_t> sizes_for(at::ScalarType t) {
  std::vector<int64_t> s = {0, 1, 7, 1001};
  if (std::find(kLargeTypes.begin(), kLargeTypes.end(), t) != kLargeTypes.end()) s.push_back(kLarge);
  return s;
}

// i % m as a tensor of n elements in dtype t (exact in every dtype for small m).
at::Tensor pattern(int64_t n, int64_t m, at::ScalarType t) {
  return at::remainder(at::arange(n, at::kLong), m).to(t);
}

void expect_equal(const at::Tensor& got, const at::Tensor& want, const std::string& what) {
  ASSERT_EQ(got.sizes(), want.sizes()) << what;
  EXPECT_TRUE(at::equal(got.to(at::kDouble), want.to(at::kDouble))) << what << ": got "
      << got.to(at::kDouble).view(-1).slice(0, 0, 8) << " want "
      << want.to(at::kDouble).view(-1).slice(0, 0, 8);
}

std::string label(const char* op, at::ScalarType t, int64_t n, bool in_place, ReduceOp r = ReduceOp::kSum) {
  return std::string(op) + " " + c10::toString(t) + " n=" + std::to_string(n) +
         (in_place ? " in-place " : " out-of-place ") + to_string(r);
}

// Calls fn(dtype, size, op) for every reduction case on N ranks (avg needs floats, the 1M
// size only sums, a byte sum must not overflow).
template <typename Fn>
void for_each_reduction_case(int N, Fn&& fn) {
  for (at::ScalarType t : kAllTypes) {
    for (int64_t n : sizes_for(t)) {
      for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMax, ReduceOp::kMin}) {
        if (op == ReduceOp::kAvg && !at::isFloatingType(t)) continue;
        if (n == kLarge && op != ReduceOp::kSum) continue;
        if (t == at::kByte && op == ReduceOp::kSum && N * (N + 1) / 2 + N * 6 > 255) continue;
        fn(t, n, op);
      }
    }
  }
}

// op over N ranks of x_r[i] = (r + 1) + p[i], in closed form.
at::Tensor reduced_pattern(const at::Tensor& p, ReduceOp op, int N) {
  switch (op) {
    case ReduceOp::kSum: return p * N + N * (N + 1) / 2.0;
    case ReduceOp::kAvg: return p + (N + 1) / 2.0;
    case ReduceOp::kMax: return p + N;
    case ReduceOp::kMin: return p + 1;
  }
  return p;
}

TEST(MpiCollectives, AllReduceEveryOpDtypeSizeAndPlacement) {
  Communicator& c = world_comm();
  const int N = c.size(), r = c.rank();
  for_each_reduction_case(N, [&](at::ScalarType t, int64_t n, ReduceOp op) {
    for (bool in_place : {true, false}) {
      // x_r[i] = (r + 1) + i % 7
      at::Tensor x = pattern(n, 7, t).add_(r + 1);
      at::Tensor want = reduced_pattern(pattern(n, 7, at::kDouble), op, N);
      if (in_place) {
        c.all_reduce(x, op)->wait();
        expect_equal(x, want, label("all_reduce", t, n, in_place, op));
      } else {
        at::Tensor before = x.clone();
        at::Tensor out = at::full({n}, 99, x.options());
        c.all_reduce(x, out, op)->wait();
        expect_equal(out, want, label("all_reduce", t, n, in_place, op));
        expect_equal(x, before, "input untouched by out-of-place all_reduce");
      }
    }
  });
}

TEST(MpiCollectives, AllReduceBoolAnyAll) {
  Communicator& c = world_comm();
  at::Tensor x = at::full({5}, c.rank() == 0, at::kBool);
  at::Tensor any = x.clone(), all = x.clone();
  c.all_reduce(any, ReduceOp::kMax)->wait();
  c.all_reduce(all, ReduceOp::kMin)->wait();
  EXPECT_TRUE(any.all().item<bool>());
  EXPECT_EQ(all.any().item<bool>(), c.size() == 1);
}

TEST(MpiCollectives, BroadcastFromEveryRoot) {
  Communicator& c = world_comm();
  for (at::ScalarType t : kAllTypes) {
    for (int64_t n : sizes_for(t)) {
      for (int root = 0; root < c.size(); ++root) {
        if (n == kLarge && root != c.size() - 1) continue;
        // x_r[i] = r * 10 + i % 13
        at::Tensor x = pattern(n, 13, t).add_(c.rank() * 10);
        c.broadcast(x, root)->wait();
        expect_equal(x, pattern(n, 13, at::kDouble) + root * 10,
                     label("broadcast", t, n, true) + " root " + std::to_string(root));
      }
    }
  }
}

TEST(MpiCollectives, ReduceToEveryRootEveryOpAndDtype) {
  Communicator& c = world_comm();
  const int N = c.size(), r = c.rank();
  for_each_reduction_case(N, [&](at::ScalarType t, int64_t n, ReduceOp op) {
    for (int root = 0; root < N; ++root) {
      if (n == kLarge && root != N - 1) continue;
      at::Tensor x = pattern(n, 7, t).add_(r + 1);  // x_r[i] = (r + 1) + i % 7
      at::Tensor want = reduced_pattern(pattern(n, 7, at::kDouble), op, N);
      c.reduce(x, root, op)->wait();
      if (r == root) expect_equal(x, want, label("reduce", t, n, true, op) + " root " + std::to_string(root));
    }
  });
  at::Tensor x = at::ones({3});
  EXPECT_THROW(c.reduce(x, N), Error);  // no such root
}

TEST(MpiCollectives, AllGatherEveryDtypeSizeAndPlacement) {
  Communicator& c = world_comm();
  const int N = c.size(), r = c.rank();
  for (at::ScalarType t : kAllTypes) {
    for (int64_t total : sizes_for(t)) {
      const int64_t n = total == kLarge ? kLarge / N : total;  // the big side is 1M
      at::Tensor want = at::cat(
          [&] { std::vector<at::Tensor> parts;
                for (int j = 0; j < N; ++j) parts.push_back(pattern(n, 5, at::kDouble) + 10 * j);
                return parts; }());
      for (bool in_place : {true, false}) {
        at::Tensor out = at::full({N * n}, 77, at::TensorOptions().dtype(t));
        at::Tensor in = in_place ? out.narrow(0, r * n, n) : at::empty({n}, out.options());
        in.copy_(pattern(n, 5, t).add_(10 * r));
        c.all_gather(in, out)->wait();
        expect_equal(out, want, label("all_gather", t, n, in_place));
      }
    }
  }
}

TEST(MpiCollectives, ReduceScatterEveryOpDtypeSizeAndPlacement) {
  Communicator& c = world_comm();
  const int N = c.size(), r = c.rank();
  for (at::ScalarType t : kAllTypes) {
    for (int64_t total : sizes_for(t)) {
      const int64_t n = total == kLarge ? kLarge / N : total;
      for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMax, ReduceOp::kMin}) {
        if (op == ReduceOp::kAvg && !at::isFloatingType(t)) continue;
        if (total == kLarge && op != ReduceOp::kSum) continue;
        if (t == at::kByte && op == ReduceOp::kSum && N * (N + 1) / 2 * N + 2 * N > 255) continue;
        for (bool in_place : {true, false}) {
          // in_q[j*n + i] = (q + 1) * (j + 1) + i % 3; rank r receives chunk r.
          at::Tensor in = at::empty({N * n}, at::TensorOptions().dtype(t));
          for (int j = 0; j < N; ++j) in.narrow(0, j * n, n).copy_(pattern(n, 3, t).add_((r + 1) * (j + 1)));
          at::Tensor before = in.clone();
          at::Tensor out = in_place ? in.narrow(0, r * n, n) : at::full({n}, 55, in.options());
          c.reduce_scatter(in, out, op)->wait();
          at::Tensor p = pattern(n, 3, at::kDouble);
          double s = r + 1.0;
          at::Tensor want;
          switch (op) {
            case ReduceOp::kSum: want = p * N + s * N * (N + 1) / 2.0; break;
            case ReduceOp::kAvg: want = p + s * (N + 1) / 2.0; break;
            case ReduceOp::kMax: want = p + s * N; break;
            case ReduceOp::kMin: want = p + s; break;
          }
          expect_equal(out, want, label("reduce_scatter", t, n, in_place, op));
          for (int j = 0; j < N && n > 0; ++j) {
            if (in_place && j == r) continue;
            expect_equal(in.narrow(0, j * n, n), before.narrow(0, j * n, n),
                         "reduce_scatter leaves the other chunks of its input alone");
          }
        }
      }
    }
  }
}

TEST(MpiCollectives, ManyAsyncOperationsCompleteInIssueOrder) {
  Communicator& c = world_comm();
  std::vector<at::Tensor> xs;
  std::vector<WorkPtr> works;
  for (int k = 0; k < 50; ++k) {
    xs.push_back(at::full({33}, static_cast<double>(k + c.rank()), at::kDouble));
    works.push_back(c.all_reduce(xs.back()));
  }
  for (int k = 49; k >= 0; --k) works[k]->wait();  // waiting out of order is fine
  const int N = c.size();
  for (int k = 0; k < 50; ++k) {
    EXPECT_DOUBLE_EQ(xs[k][0].item<double>(), N * k + N * (N - 1) / 2.0) << "op " << k;
    EXPECT_TRUE(works[k]->is_completed());
  }
  EXPECT_LT(works[0]->sequence(), works[49]->sequence());
  c.barrier()->wait();
}

// The memory contract (communicator.h): the MPI backend holds tensors the caller dropped until
// their operation completes, a collective's input while its peers have not even issued theirs
// (they wait on a second communicator until rank 0 has looked), a send dropped inside a group
// before the group is closed (comm_contract_cases.h; the same cases run on the local backend in
// the unit tests and on NCCL in the GPU tests).
TEST(MpiCollectives, OperationsHoldTensorsTheCallerDroppedUntilTheyComplete) {
  Communicator& c = world_comm();
  auto gate = c.split(0, c.rank(), "gate");
  ASSERT_NE(gate, nullptr);
  contract_cases::Hooks hooks;
  hooks.gate = gate.get();
  const c10::Device cpu(c10::kCPU);
  contract_cases::check_all_reduce_holds_a_dropped_input(c, cpu, hooks);
  contract_cases::check_group_holds_a_send_dropped_before_close(c, cpu, /*launches_at_close=*/false);
  c.barrier()->wait();
}

TEST(MpiCollectives, SplitGroupsRankByKeyAndReduceWithinGroup) {
  Communicator& c = world_comm();
  const int N = c.size(), r = c.rank();
  // Two groups by parity, ranked in reverse order of world rank (key = -rank).
  auto sub = c.split(r % 2, -r, "parity");
  ASSERT_NE(sub, nullptr);
  std::vector<int> members;
  for (int q = 0; q < N; ++q) if (q % 2 == r % 2) members.push_back(q);
  EXPECT_EQ(sub->size(), static_cast<int>(members.size()));
  int expected_rank = 0;
  for (int q : members) if (q > r) ++expected_rank;
  EXPECT_EQ(sub->rank(), expected_rank);
  EXPECT_EQ(sub->name(), "world/parity");
  for (at::ScalarType t : {at::kFloat, at::kBFloat16, at::kLong}) {
    at::Tensor x = at::full({9}, r + 1, at::TensorOptions().dtype(t));
    sub->all_reduce(x)->wait();
    double want = 0;
    for (int q : members) want += q + 1;
    EXPECT_EQ(x.to(at::kDouble)[8].item<double>(), want) << c10::toString(t);
  }
  // A group that gathers and scatters: all collectives work on sub-groups too.
  at::Tensor g = at::empty({sub->size() * 2}, at::kFloat);
  sub->all_gather(at::full({2}, static_cast<float>(r), at::kFloat), g)->wait();
  for (size_t j = 0; j < members.size(); ++j) {
    // Member with sub-rank j is the j-th largest world rank of the group.
    int q = members[members.size() - 1 - j];
    EXPECT_EQ(g[2 * j].item<float>(), q);
  }
  // color < 0: this rank joins no group.
  auto none = c.split(r == 0 ? -1 : 0, r, "no0");
  EXPECT_EQ(none == nullptr, r == 0);
  if (none) EXPECT_EQ(none->size(), N - 1);
  // Nested split of a sub-group.
  auto nested = sub->split(0, 0, "all");
  ASSERT_NE(nested, nullptr);
  EXPECT_EQ(nested->size(), sub->size());
  EXPECT_EQ(nested->name(), "world/parity/all");
  // A host-only split (the MPI backend's is split()'s): the same groups, host collectives.
  auto host = c.split_host(r % 2, -r, "parity_host");
  ASSERT_NE(host, nullptr);
  EXPECT_EQ(host->size(), sub->size());
  EXPECT_EQ(host->rank(), sub->rank());
  EXPECT_EQ(host->name(), "world/parity_host");
  at::Tensor h = at::full({3}, r + 1, at::kLong);
  host->all_reduce(h)->wait();
  int64_t want = 0;
  for (int q : members) want += q + 1;
  EXPECT_EQ(h[2].item<int64_t>(), want);
  EXPECT_EQ(c.split_host(r == 0 ? -1 : 0, r, "host_no0") == nullptr, r == 0);
}

TEST(MpiCollectives, MeshSplitsTensorThenDataParallel) {
  Communicator& c = world_comm();
  const int N = c.size(), r = c.rank();
  for (int tp = 1; tp <= N; tp *= 2) {
    if (N % tp) continue;
    Mesh mesh(c, tp);
    EXPECT_EQ(mesh.tp_size(), tp);
    EXPECT_EQ(mesh.dp_size(), N / tp);
    EXPECT_EQ(mesh.tp_rank(), r % tp);
    EXPECT_EQ(mesh.dp_rank(), r / tp);
    at::Tensor x = at::full({1}, static_cast<double>(r), at::kDouble);
    mesh.tp().all_reduce(x)->wait();
    int g = r / tp;  // tensor group g has ranks g*tp .. g*tp+tp-1
    EXPECT_EQ(x.item<double>(), tp * g * tp + tp * (tp - 1) / 2.0);
    at::Tensor y = at::full({1}, static_cast<double>(r), at::kDouble);
    mesh.dp().all_reduce(y)->wait();
    int p = r % tp;  // data group p has ranks p, p+tp, ...
    double want = 0;
    for (int q = p; q < N; q += tp) want += q;
    EXPECT_EQ(y.item<double>(), want);
  }
}

TEST(MpiCollectives, MeshRejectsBadTensorParallelSizesBeforeAnyCollective) {
  Communicator& c = world_comm();
  uint64_t before = c.issued();
  EXPECT_THROW({ Mesh m(c, 0); }, Error);
  EXPECT_THROW({ Mesh m(c, c.size() + 1); }, Error);
  if (c.size() > 2) EXPECT_THROW({ Mesh m(c, c.size() - 1); }, Error);
  try {
    Mesh m(c, c.size() * 2);
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("larger than the world"), std::string::npos) << e.what();
  }
  EXPECT_EQ(c.issued(), before);
}

TEST(MpiCollectives, DebugModeNamesAMismatchOnEveryRankInsteadOfHanging) {
  CommOptions options;
  options.debug_collectives = true;
  options.name = "debug";
  options.timeout = std::chrono::seconds(60);
  auto c = create_communicator("mpi", testing_util::world(), c10::Device(c10::kCPU), options);
  if (c->size() == 1) GTEST_SKIP() << "needs two ranks";
  // Matching calls pass.
  at::Tensor ok = at::ones({4, 4});
  c->all_reduce(ok)->wait();
  EXPECT_EQ(ok[0][0].item<float>(), c->size());
  // Different shapes: every rank throws, naming both calls.
  at::Tensor x = c->rank() == 0 ? at::ones({4, 4}) : at::ones({8});
  try {
    c->all_reduce(x);
    ADD_FAILURE() << "mismatch not detected";
  } catch (const Error& e) {
    std::string m = e.what();
    EXPECT_NE(m.find("collective mismatch"), std::string::npos) << m;
    EXPECT_NE(m.find("rank 0 called all_reduce(Float[4,4]"), std::string::npos) << m;
    EXPECT_NE(m.find("[8]"), std::string::npos) << m;
  }
  // Different operations are caught too.
  at::Tensor y = at::ones({3});
  EXPECT_THROW({
    if (c->rank() == 0) c->broadcast(y, 0); else c->all_reduce(y);
  }, Error);
}

TEST(MpiCollectives, ArgumentErrorsNameTheProblem) {
  Communicator& c = world_comm();
  auto message = [](auto&& fn) {
    try { fn(); } catch (const Error& e) { return std::string(e.what()); }
    return std::string("no error");
  };
  EXPECT_NE(message([&] { c.broadcast(at::ones({2}), c.size()); }).find("root"), std::string::npos);
  EXPECT_NE(message([&] { c.all_gather(at::ones({2}), at::ones({2 * c.size() + 1})); }).find("needs size()"), std::string::npos);
  EXPECT_NE(message([&] { c.all_reduce(at::ones({4, 4}).t()); }).find("not contiguous"), std::string::npos);
  EXPECT_NE(message([&] { c.all_reduce(at::ones({2}, at::kLong), ReduceOp::kAvg); }).find("avg needs"), std::string::npos);
  EXPECT_NE(message([&] { c.all_reduce(at::ones({2}), at::ones({2}, at::kDouble), ReduceOp::kSum); }).find("dtype"), std::string::npos);
  EXPECT_NE(message([&] { c.all_reduce(at::ones({2}, at::kComplexFloat)); }).find("not supported"), std::string::npos);
}

}  // namespace
}  // namespace dtrain::dist
