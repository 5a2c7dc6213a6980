// The communicator contracts every backend keeps, on the local backend (the MPI tests run the
// same cases on MPI, the GPU tests on NCCL): tensors the caller dropped are held until their
// operation completes (comm_contract_cases.h); a group belongs to the thread that began it; and
// the teardown decision of a backend that must not block in its destructor (NCCL's).
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <thread>

#include <ATen/ATen.h>

#include "../../dist/src/teardown.h"
#include "comm_contract_cases.h"
#include "dtrain/dist/communicator.h"
#include "dtrain/dist/error.h"
#include "test_util.h"

namespace dtrain::dist {
namespace {

using testing_util::error_of;

std::unique_ptr<Communicator> local_comm() { return create_communicator("local", World{}, c10::Device(c10::kCPU)); }

// Regression (a send to oneself kept only a copy): the local backend holds the tensors it was
// given, not copies of them, until their operations complete.
TEST(CommContract, LocalBackendHoldsTensorsTheCallerDroppedUntilTheyComplete) {
  auto c = local_comm();
  const c10::Device cpu(c10::kCPU);
  contract_cases::check_all_reduce_holds_a_dropped_input(*c, cpu);
  contract_cases::check_group_holds_a_send_dropped_before_close(*c, cpu, /*launches_at_close=*/false);
}

// Regression (NCCL's group state is per thread, the backend's was per communicator): while a
// group is open, another thread's operations wait for its end and join no group.
TEST(CommGroups, AnotherThreadsOperationsWaitForTheGroupToEnd) {
  auto c = local_comm();
  std::atomic<int> issued{0};
  c->begin_group();
  std::thread other([&] {
    at::Tensor x = at::ones({4});
    c->all_reduce(x)->wait();
    ++issued;
    c->send(at::full({3}, 7.0), 0);
    ++issued;
    c->barrier()->wait();
    ++issued;
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  EXPECT_EQ(issued.load(), 0) << "an operation from another thread ran inside this thread's group";
  at::Tensor mine = at::ones({2});
  c->all_reduce(mine)->wait();  // the group's own thread is not held back
  c->end_group();
  other.join();
  EXPECT_EQ(issued.load(), 3);
  at::Tensor got = at::empty({3});
  c->recv(got, 0)->wait();
  EXPECT_TRUE(at::equal(got, at::full({3}, 7.0)));
  // Two threads' groups take turns.
  std::atomic<bool> second_began{false};
  CommGroup first(*c);
  std::thread t([&] {
    CommGroup second(*c);
    second_began = true;
    second.close();
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  EXPECT_FALSE(second_began.load()) << "a second thread began a group while the first was open";
  first.close();
  t.join();
  EXPECT_TRUE(second_began.load());
}

TEST(CommGroups, EndingOrNestingAGroupOnTheWrongThreadIsAnError) {
  auto c = local_comm();
  const std::string none = error_of([&] { c->end_group(); });
  EXPECT_NE(none.find("end_group() on a thread that has no group open"), std::string::npos) << none;
  c->begin_group();
  const std::string nested = error_of([&] { c->begin_group(); });
  EXPECT_NE(nested.find("groups do not nest"), std::string::npos) << nested;
  std::string elsewhere;
  std::thread([&] { elsewhere = error_of([&] { c->end_group(); }); }).join();
  EXPECT_NE(elsewhere.find("a group ends on the thread that began it"), std::string::npos) << elsewhere;
  c->end_group();
  // Closed: any thread may issue (and group) again.
  std::thread([&] {
    CommGroup group(*c);
    at::Tensor x = at::ones({1});
    c->all_reduce(x)->wait();
    group.close();
  }).join();
  EXPECT_EQ(c->issued(), 1u);
}

// A Work whose completion the test sets (and whose query may fail, as a sticky CUDA error's).
class FakeWork final : public Work {
 public:
  explicit FakeWork(uint64_t seq) : seq_(seq) {}
  void wait() override {}
  void synchronize() override {}
  bool is_completed() override {
    if (query_fails) throw Error("CUDA error: an illegal memory access was encountered");
    return done;
  }
  uint64_t sequence() const override { return seq_; }
  bool done = false;
  bool query_fails = false;

 private:
  const uint64_t seq_;
};

// The NCCL communicator's destructor destroys (ncclCommDestroy waits for the queued work, and
// a dead peer makes it wait forever) only an idle, healthy communicator; it aborts otherwise.
TEST(CommTeardown, DestroysOnlyAnIdleHealthyCommunicatorAndAbortsOtherwise) {
  TeardownTracker t;
  EXPECT_EQ(t.decide().how, Teardown::kDestroy) << "nothing issued";
  auto work = std::make_shared<FakeWork>(7);
  t.launched(work);
  TeardownDecision d = t.decide();
  EXPECT_EQ(d.how, Teardown::kAbort) << "the last operation is still queued";
  EXPECT_NE(d.why.find("#7"), std::string::npos) << d.why;
  work->done = true;
  EXPECT_EQ(t.decide().how, Teardown::kDestroy) << "the last operation (so every one before it) completed";
  t.set_unlaunched(2);
  d = t.decide();
  EXPECT_EQ(d.how, Teardown::kAbort);
  EXPECT_NE(d.why.find("2 operation(s) issued in a group that was never ended"), std::string::npos) << d.why;
  t.set_unlaunched(0);
  work->query_fails = true;
  d = t.decide();
  EXPECT_EQ(d.how, Teardown::kAbort) << "a completion that cannot be queried";
  EXPECT_NE(d.why.find("illegal memory access"), std::string::npos) << d.why;
  work->query_fails = false;
  EXPECT_FALSE(t.has_failed());
  t.failed("ncclAllReduce returned unhandled system error");
  EXPECT_TRUE(t.has_failed());
  d = t.decide();
  EXPECT_EQ(d.how, Teardown::kAbort) << "after a failure, even when idle";
  EXPECT_NE(d.why.find("unhandled system error"), std::string::npos) << d.why;
  const TeardownCounts before = teardown_counts();
  count_teardown(Teardown::kAbort);
  count_teardown(Teardown::kDestroy);
  count_teardown(Teardown::kAbort);
  EXPECT_EQ(teardown_counts().aborted, before.aborted + 2);
  EXPECT_EQ(teardown_counts().destroyed, before.destroyed + 1);
}

}  // namespace
}  // namespace dtrain::dist
