// Point-to-point send and receive (pipeline stages' transport) against closed forms: a ring
// and pairwise exchanges issued all at once (large messages, so a blocking implementation
// would deadlock), several messages in order, sends to oneself, the per-peer counts, the
// bytes counted, and receives whose size or shape differs from the message (an error naming
// both sides at wait(), not a hang or silent truncation). The local backend's self-messages
// too. The stalled-peer case (the watchdog ends the job naming the send) is mpi.fault.p2p_stall.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include <ATen/ATen.h>

#include "dtrain/dist/communicator.h"
#include "dtrain/dist/error.h"
#include "dtrain/dist/world.h"
#include "test_util.h"

namespace dtrain::dist {
namespace {

using testing_util::world_comm;

// Rank r's k-th message to rank p: n values r * 1000 + p * 100 + k + i / n.
at::Tensor message(int from, int to, int k, int64_t n, at::ScalarType dtype = at::kFloat) {
  at::Tensor t = at::arange(n, at::kDouble) / static_cast<double>(n) + (from * 1000 + to * 100 + k);
  return t.to(dtype);
}

std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(PointToPoint, RingOfLargeMessagesIssuedAtOnceMatchesTheClosedForm) {
  auto& comm = world_comm();
  const int n = comm.size(), r = comm.rank();
  const int next = (r + 1) % n, prev = (r + n - 1) % n;
  const int64_t len = 1 << 20;  // 4 MiB: past any eager limit, so each send waits for its receive
  std::vector<WorkPtr> works;
  std::vector<at::Tensor> got;
  for (int k = 0; k < 3; ++k) {
    // Different sizes per message: the k-th receive must match the k-th send.
    works.push_back(comm.send(message(r, next, k, len + k), next));
    got.push_back(at::empty({len + k}));
    works.push_back(comm.recv(got.back(), prev));
  }
  for (auto& w : works) w->wait();
  for (int k = 0; k < 3; ++k) {
    EXPECT_TRUE(at::equal(got[k], message(prev, r, k, len + k))) << "message " << k << " from rank " << prev;
  }
  // Counted per direction and peer (the world communicator is shared with earlier tests).
  EXPECT_EQ(works[4]->sequence(), works[0]->sequence() + 2) << "the third send to rank " << next;
  EXPECT_EQ(works[5]->sequence(), works[1]->sequence() + 2) << "the third receive from rank " << prev;
}

TEST(PointToPoint, PairsExchangeBothWaysWithAnyDtypeAndSelf) {
  auto& comm = world_comm();
  const int r = comm.rank();
  const int peer = (r ^ 1) < comm.size() ? (r ^ 1) : r;  // an odd world's last rank talks to itself
  for (at::ScalarType dtype : {at::kFloat, at::kDouble, at::kLong, at::kBFloat16}) {
    at::Tensor in = at::empty({300, 1000}, dtype);
    WorkPtr rw = comm.recv(in, peer);
    WorkPtr sw = comm.send(message(r, peer, 0, 300 * 1000, dtype).view({300, 1000}), peer);
    sw->wait();
    rw->wait();
    EXPECT_TRUE(at::equal(in, message(peer, r, 0, 300 * 1000, dtype).view({300, 1000}))) << dtype;
  }
  // To oneself, receive first.
  at::Tensor self = at::empty({5}, at::kLong);
  WorkPtr rw = comm.recv(self, r);
  comm.send(at::arange(5, at::kLong) * (r + 1), r)->wait();
  rw->wait();
  EXPECT_TRUE(at::equal(self, at::arange(5, at::kLong) * (r + 1)));
}

TEST(PointToPoint, SendsAreCountedAsTheirBytes) {
  auto& comm = world_comm();
  if (comm.size() < 2) GTEST_SKIP() << "one rank";
  const int r = comm.rank(), n = comm.size();
  const CommTraffic before = comm.traffic();
  at::Tensor in = at::empty({1000}, at::kDouble);
  WorkPtr rw = comm.recv(in, (r + n - 1) % n);
  comm.send(at::ones({1000}, at::kDouble), (r + 1) % n)->wait();
  rw->wait();
  const CommTraffic after = comm.traffic();
  EXPECT_EQ(after.ops - before.ops, 1u);
  EXPECT_DOUBLE_EQ(after.bus_bytes - before.bus_bytes, 8000);
  EXPECT_DOUBLE_EQ(after.payload_bytes - before.payload_bytes, 8000);
}

TEST(PointToPoint, ReceiveOfAnotherSizeIsAnErrorNamingBothSides) {
  auto& comm = world_comm();
  if (comm.size() < 2) GTEST_SKIP() << "one rank";
  const int r = comm.rank();
  if (r < 2) {
    const int peer = 1 - r;
    if (r == 0) {
      comm.send(at::ones({8}), peer)->wait();
      comm.send(at::ones({8}), peer)->wait();
    } else {
      const std::string small = error_of([&] { comm.recv(at::empty({4}), peer)->wait(); });
      EXPECT_EQ(small.rfind("recv #", 0), 0u) << small;
      EXPECT_NE(small.find(" from rank 0 on '" + comm.name() + "'"), std::string::npos) << small;
      EXPECT_NE(small.find("sent more than the 16 bytes"), std::string::npos) << small;
      const std::string large = error_of([&] { comm.recv(at::empty({16}), peer)->wait(); });
      EXPECT_NE(large.find(" from rank 0 on '" + comm.name() + "'"), std::string::npos) << large;
      EXPECT_NE(large.find("32 bytes where 64 were expected"), std::string::npos) << large;
    }
  }
  comm.barrier()->wait();
  // Debug mode: each message carries its dtype and shape; the same bytes in another shape are
  // named too.
  CommOptions options;
  options.debug_collectives = true;
  options.name = "debug";
  std::unique_ptr<Communicator> checked = create_communicator("mpi", detect_world(), c10::Device(c10::kCPU), options);
  if (r == 0) checked->send(at::ones({2, 4}), 1)->wait();
  if (r == 1) {
    const std::string shape = error_of([&] { checked->recv(at::empty({4, 2}), 0)->wait(); });
    EXPECT_NE(shape.find("rank 0 sent Float[2,4] but this rank expected Float[4,2]"), std::string::npos) << shape;
  }
  checked->barrier()->wait();
}

TEST(PointToPoint, BadArgumentsAreRefusedAtTheCall) {
  auto& comm = world_comm();
  const std::string far = error_of([&] { comm.send(at::ones({2}), comm.size()); });
  EXPECT_NE(far.find("peer " + std::to_string(comm.size()) + " is not a rank of this communicator"), std::string::npos)
      << far;
  const std::string strided = error_of([&] { comm.recv(at::ones({4, 4}).t(), comm.rank()); });
  EXPECT_NE(strided.find("is not contiguous"), std::string::npos) << strided;
}

TEST(PointToPoint, LocalBackendMatchesSelfMessagesInOrder) {
  auto lone = create_communicator("local", World{}, c10::Device(c10::kCPU));
  at::Tensor a = at::empty({3}), b = at::empty({3});
  WorkPtr ra = lone->recv(a, 0);
  EXPECT_FALSE(ra->is_completed()) << "a receive waits for its send";
  lone->send(at::full({3}, 1.0), 0);
  lone->send(at::full({3}, 2.0), 0);
  WorkPtr rb = lone->recv(b, 0);
  ra->wait();
  rb->wait();
  EXPECT_TRUE(at::equal(a, at::full({3}, 1.0)));
  EXPECT_TRUE(at::equal(b, at::full({3}, 2.0)));
  EXPECT_EQ(rb->sequence(), 2u);
  lone->send(at::ones({2, 3}), 0);
  const std::string shape = error_of([&] { lone->recv(at::empty({3, 2}), 0)->wait(); });
  EXPECT_NE(shape.find("the matching send has Float[2, 3]"), std::string::npos) << shape;
  const std::string other = error_of([&] { lone->send(at::ones({1}), 1); });
  EXPECT_NE(other.find("peer 1 is not a rank"), std::string::npos) << other;
}

}  // namespace
}  // namespace dtrain::dist
