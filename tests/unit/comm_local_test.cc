// The local backend, the registry and the watchdog, in one process.
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include "../../dist/src/async.h"
#include "../../dist/src/backends.h"
#include "dtrain/dist/communicator.h"
#include "dtrain/dist/error.h"
#include "test_util.h"

namespace dtrain::dist {
namespace {

std::unique_ptr<Communicator> local() {
  return create_communicator("local", World{}, c10::Device(c10::kCPU));
}

TEST(LocalBackend, CollectivesOfOneRankAreIdentitiesAndCopies) {
  auto c = local();
  EXPECT_EQ(c->size(), 1);
  EXPECT_STREQ(c->backend(), "local");
  at::Tensor x = at::arange(5, at::kFloat);
  c->all_reduce(x, ReduceOp::kAvg)->wait();
  EXPECT_TRUE(at::equal(x, at::arange(5, at::kFloat)));
  at::Tensor out = at::zeros({5});
  c->all_reduce(x, out, ReduceOp::kSum)->wait();
  EXPECT_TRUE(at::equal(out, x));
  at::Tensor g = at::zeros({5});
  c->all_gather(x, g)->wait();
  EXPECT_TRUE(at::equal(g, x));
  at::Tensor s = at::zeros({5});
  c->reduce_scatter(x, s)->wait();
  EXPECT_TRUE(at::equal(s, x));
  c->broadcast(x, 0)->wait();
  c->barrier()->wait();
  at::Tensor empty = at::empty({0});
  c->all_reduce(empty)->wait();
  EXPECT_EQ(c->issued(), 7u);
  auto sub = c->split(0, 0, "tp");
  ASSERT_NE(sub, nullptr);
  EXPECT_EQ(sub->name(), "world/tp");
  EXPECT_EQ(c->split(-1, 0, "none"), nullptr);
}

TEST(Registry, UnknownBackendListsTheKnownOnes) {
  try {
    create_communicator("gloo", World{}, c10::Device(c10::kCPU));
    FAIL();
  } catch (const Error& e) {
    std::string m = e.what();
    EXPECT_NE(m.find("unknown communicator backend 'gloo'"), std::string::npos) << m;
    EXPECT_NE(m.find("mpi"), std::string::npos) << m;
  }
  auto names = available_backends();
  EXPECT_NE(std::find(names.begin(), names.end(), "mpi"), names.end());
}

TEST(Registry, AutoPicksLocalForALoneCpuProcess) {
  auto c = create_communicator("auto", World{}, c10::Device(c10::kCPU));
  EXPECT_STREQ(c->backend(), "local");
}

TEST(Registry, LocalRefusesAWorldOfSeveralRanks) {
  World w;
  w.size = 2;
  EXPECT_THROW(create_communicator("local", w, c10::Device(c10::kCPU)), Error);
}

TEST(Registry, NcclNeedsACudaDevice) {
  auto names = available_backends();
  if (std::find(names.begin(), names.end(), "nccl") == names.end()) {
    try {
      create_communicator("nccl", World{}, c10::Device(c10::kCPU));
      FAIL();
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("built without NCCL"), std::string::npos);
    }
    return;
  }
  try {
    create_communicator("nccl", World{}, c10::Device(c10::kCPU));
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("needs a CUDA device"), std::string::npos) << e.what();
  }
}

// NCCL_COMM_BLOCKING=0 would turn every NCCL call into ncclInProgress, which dtrain does not
// poll: refused before NCCL starts, naming the variable.
TEST(Registry, NcclRefusesNonBlockingCommunicatorsFromTheEnvironment) {
  auto names = available_backends();
  if (std::find(names.begin(), names.end(), "nccl") == names.end()) GTEST_SKIP() << "built without NCCL";
  setenv("NCCL_COMM_BLOCKING", "0", 1);
  struct Unset {
    ~Unset() { unsetenv("NCCL_COMM_BLOCKING"); }
  } unset;
  EXPECT_TRUE(testing_util::throws_error_with([] { create_communicator("nccl", World{}, c10::Device(c10::kCPU)); },
                                              "NCCL_COMM_BLOCKING=0; unset it"));
}

// all_gather's input and reduce_scatter's output may share the other buffer's memory only as
// this rank's slice (in place); another overlap is refused before the backend reads either.
TEST(Collectives, AnOverlapThatIsNotTheRanksSliceIsRefused) {
  auto comm = create_communicator("local", World{}, c10::Device(c10::kCPU));
  at::Tensor buf = at::arange(8, at::kFloat);
  const at::Tensor whole = buf.narrow(0, 0, 4), shifted = buf.narrow(0, 1, 4);
  EXPECT_TRUE(testing_util::throws_error_with([&] { comm->all_gather(shifted, whole); },
                                              "is not this rank's slice of it (rank 0: elements [0, 4))"));
  EXPECT_TRUE(testing_util::throws_error_with([&] { comm->reduce_scatter(whole, shifted); },
                                              "the output overlaps the other buffer"));
  comm->all_gather(whole, whole)->wait();  // in place: this rank's slice
  EXPECT_TRUE(at::equal(whole, at::arange(4, at::kFloat)));
  comm->reduce_scatter(buf.narrow(0, 4, 4), buf.narrow(0, 0, 4))->wait();  // apart
  EXPECT_TRUE(at::equal(buf.narrow(0, 0, 4), at::arange(4, 8, at::kFloat)));
}

TEST(Registry, AutoChoosesMpiWhenRanksShareAGpu) {
  World w;
  w.size = 4;
  w.local_size = 2;  // two ranks on this node
  const std::string shared = "ranks 0 and 1 on host n1 use the same GPU (PCI 0000:17:00.0)";
  EXPECT_EQ(choose_backend("auto", w, /*cuda_device=*/true, /*shared_gpu=*/"", true), "nccl");
  EXPECT_EQ(choose_backend("auto", w, true, shared, true), "mpi");  // the one-GPU machine
  EXPECT_EQ(choose_backend("auto", w, true, "", /*have_nccl=*/false), "mpi");
  EXPECT_EQ(choose_backend("auto", w, /*cuda_device=*/false, "", true), "mpi");
  EXPECT_EQ(choose_backend("auto", World{}, false, "", true), "local");
  EXPECT_EQ(choose_backend("mpi", w, true, shared, true), "mpi");
  try {
    choose_backend("nccl", w, true, shared, true);
    FAIL() << "nccl with two ranks on one GPU";
  } catch (const Error& e) {
    std::string m = e.what();
    EXPECT_NE(m.find(shared), std::string::npos) << m;
    EXPECT_NE(m.find("--backend=mpi"), std::string::npos) << m;
  }
  EXPECT_THROW(choose_backend("nccl", w, true, "", /*have_nccl=*/false), Error);
}

// Sharing is decided from the GPUs' identities, not from how many GPUs a rank sees: with
// per-rank CUDA_VISIBLE_DEVICES (Slurm --gpus-per-task) each of 8 local ranks sees one GPU,
// a different one, and NCCL works (issue 19, item 6; before, 8 ranks > 1 visible GPU meant
// "shared": auto fell back to MPI staging and --backend=nccl threw).
TEST(Registry, RanksThatSeeOneGpuEachShareNothing) {
  std::vector<std::string> ids;
  for (int r = 0; r < 8; ++r) ids.push_back("n1 0000:" + std::to_string(0x10 + r) + ":00.0");
  for (int r = 0; r < 8; ++r) ids.push_back("n2 0000:" + std::to_string(0x10 + r) + ":00.0");
  EXPECT_EQ(find_shared_gpu(ids), "");  // the same bus ids on another host are other GPUs
  World w;
  w.size = 16;
  w.local_size = 8;
  EXPECT_EQ(choose_backend("auto", w, true, find_shared_gpu(ids), true), "nccl");
  EXPECT_EQ(choose_backend("nccl", w, true, find_shared_gpu(ids), true), "nccl");
  // Two ranks of n2 given the same GPU: named, with both ranks.
  ids[13] = ids[9];
  EXPECT_EQ(find_shared_gpu(ids), "ranks 9 and 13 on host n2 use the same GPU (PCI 0000:17:00.0)");
  EXPECT_EQ(choose_backend("auto", w, true, find_shared_gpu(ids), true), "mpi");
  // A GPU whose identity is unknown matches nothing.
  EXPECT_EQ(find_shared_gpu({"n1 ", "n1 ", "n1"}), "");
}

// NCCL would fault with an illegal address on a tensor of another GPU: a clear error instead
// (issue 19, item 11).
TEST(Registry, ATensorOnAnotherGpuThanTheCommunicatorsIsAClearError) {
  const c10::Device gpu0(c10::kCUDA, 0), gpu1(c10::kCUDA, 1);
  EXPECT_NO_THROW(check_on_comm_device("world.all_reduce", gpu0, gpu0));
  try {
    check_on_comm_device("world.all_reduce", gpu1, gpu0);
    FAIL() << "a cuda:1 tensor on a cuda:0 communicator";
  } catch (const Error& e) {
    std::string m = e.what();
    EXPECT_NE(m.find("world.all_reduce: the tensor is on cuda:1 but this communicator's GPU is cuda:0"),
              std::string::npos) << m;
    EXPECT_NE(m.find(".to(cuda:0)"), std::string::npos) << m;
  }
}

TEST(Registry, NonPositiveTimeoutIsRejected) {
  CommOptions o;
  o.timeout = std::chrono::milliseconds(0);
  EXPECT_THROW(create_communicator("local", World{}, c10::Device(c10::kCPU), o), Error);
}

// Watches entry until the watchdog ends it (timeout or failure) or `wait` passes; returns the
// message it would have exited with ("" if none) and how long that took.
std::pair<std::string, double> fatal_message_of(Watchdog::Entry entry, std::chrono::seconds wait) {
  std::mutex m;
  std::condition_variable cv;
  std::string message;
  Watchdog::instance().set_timeout_handler_for_testing([&](const std::string& msg) {
    std::lock_guard<std::mutex> lock(m);
    message = msg;
    cv.notify_all();
  });
  const auto start = std::chrono::steady_clock::now();
  uint64_t token = Watchdog::instance().watch(std::move(entry));
  std::string got;
  {
    std::unique_lock<std::mutex> lock(m);
    cv.wait_for(lock, wait, [&] { return !message.empty(); });
    got = message;
  }
  const double waited_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  Watchdog::instance().unwatch(token);
  Watchdog::instance().set_timeout_handler_for_testing(nullptr);
  return {got, waited_s};
}

TEST(Watchdog, ReportsAnOperationThatOutlivesItsTimeout) {
  const std::string message = fatal_message_of({"all_reduce #42 on 'world' (fake)", std::chrono::milliseconds(300),
                                                 [] { return false; }, nullptr},
                                                std::chrono::seconds(5))
                                  .first;
  EXPECT_NE(message.find("collective timeout: all_reduce #42 on 'world'"), std::string::npos) << message;
  EXPECT_NE(message.find("0.3 s"), std::string::npos) << message;
}

// A completion check that throws (a sticky CUDA error in an event query) must not take the
// watchdog thread down: the operation is reported at its timeout like any other.
TEST(Watchdog, ACompletionCheckThatThrowsEndsInTheTimeout) {
  const std::string message =
      fatal_message_of({"all_reduce #7 on 'gpu' (fake)", std::chrono::milliseconds(300),
                        []() -> bool { throw std::runtime_error("CUDA error: an illegal memory access"); }, nullptr},
                       std::chrono::seconds(5))
          .first;
  EXPECT_NE(message.find("collective timeout: all_reduce #7 on 'gpu'"), std::string::npos) << message;
}

// NCCL's asynchronous error (a peer or the network failed) ends the job at once with that
// error, not after the collective timeout as a "stalled peer" (issue 19, item 4).
TEST(Watchdog, AnOperationThatReportsAFailureEndsTheJobAtOnce) {
  std::atomic<int> polls{0};
  Watchdog::Entry entry{"all_reduce #9 on 'world' (fake nccl)", std::chrono::minutes(10),
                        [] { return false; }, nullptr};
  entry.failure = [&]() -> std::string {
    return ++polls < 3 ? "" : "NCCL 2.28.9 reported remote process exited or there was a network error";
  };
  auto [message, waited_s] = fatal_message_of(std::move(entry), std::chrono::seconds(10));
  EXPECT_NE(message.find("collective failure: all_reduce #9 on 'world' (fake nccl) failed: NCCL 2.28.9 "
                         "reported remote process exited"),
            std::string::npos) << message;
  EXPECT_EQ(message.find("timeout"), std::string::npos) << message;
  EXPECT_LT(waited_s, 5.0) << "reported within a few polls, not at the 10-minute timeout";
}

void watch_a_failing_barrier_then_wait() {
  Watchdog::Entry e{"barrier #3 on 'world' (fake)", std::chrono::minutes(10), [] { return false; }, nullptr};
  e.failure = [] { return std::string("unhandled system error"); };
  Watchdog::instance().watch(std::move(e));
  std::this_thread::sleep_for(std::chrono::seconds(5));
  std::exit(0);
}

TEST(WatchdogDeathTest, AFailureExitsWithTheFailureCode) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(watch_a_failing_barrier_then_wait(), testing::ExitedWithCode(kExitFailure),
              "collective failure: barrier #3 .*unhandled system error");
}

void watch_after_shutdown_then_wait() {
  Watchdog::instance().watch({"all_reduce #1 on 'world' (fake)", std::chrono::milliseconds(100),
                              []() -> bool {
                                std::fprintf(stderr, "polled after shutdown\n");
                                std::_Exit(3);
                              },
                              nullptr});
  Watchdog::instance().shutdown();
  Watchdog::instance().watch({"all_reduce #2 on 'world' (fake)", std::chrono::milliseconds(100),
                              []() -> bool { std::_Exit(4); }, nullptr});
  std::this_thread::sleep_for(std::chrono::milliseconds(600));
  std::fprintf(stderr, "not polled\n");
  std::exit(0);
}

// After shutdown() (at process exit, before the CUDA runtime goes) nothing is polled: no event
// query against a torn-down runtime, no spurious "cannot tell whether ... completed".
TEST(WatchdogDeathTest, NothingIsPolledAfterShutdown) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(watch_after_shutdown_then_wait(), testing::ExitedWithCode(0), "not polled");
}

// unwatch_owner() drops every entry of a communicator (its destructor calls it before freeing
// what the entries use).
TEST(Watchdog, UnwatchOwnerDropsThatOwnersEntries) {
  std::atomic<bool> reported{false};
  Watchdog::instance().set_timeout_handler_for_testing([&](const std::string&) { reported = true; });
  int owner = 0;
  Watchdog::Entry e{"all_reduce #5 on 'x' (fake)", std::chrono::milliseconds(300), [] { return false; }, nullptr};
  e.owner = &owner;
  Watchdog::instance().watch(std::move(e));
  Watchdog::instance().unwatch_owner(&owner);
  std::this_thread::sleep_for(std::chrono::milliseconds(600));
  Watchdog::instance().set_timeout_handler_for_testing(nullptr);
  EXPECT_FALSE(reported);
}

TEST(Watchdog, FinishedOperationsAreNotReported) {
  std::atomic<bool> reported{false};
  Watchdog::instance().set_timeout_handler_for_testing([&](const std::string&) { reported = true; });
  Watchdog::instance().watch({"done op", std::chrono::milliseconds(200), [] { return true; }, nullptr});
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  Watchdog::instance().set_timeout_handler_for_testing(nullptr);
  EXPECT_FALSE(reported);
}

TEST(WatchdogDeathTest, TimeoutExitsWithTheTimeoutCode) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        Watchdog::instance().watch(
            {"barrier #7 on 'world' (fake)", std::chrono::milliseconds(200), [] { return false; }, nullptr});
        std::this_thread::sleep_for(std::chrono::seconds(5));
        std::exit(0);
      },
      testing::ExitedWithCode(kExitCollectiveTimeout), "collective timeout: barrier #7");
}

// A blocking call bounded by WatchedCall (a communicator's creation waiting for a peer that
// died) is reported at its timeout; one that returns in time is not.
TEST(Watchdog, AWatchedCallIsBoundedByItsTimeout) {
  std::mutex m;
  std::vector<std::string> messages;
  Watchdog::instance().set_timeout_handler_for_testing([&](const std::string& msg) {
    std::lock_guard<std::mutex> lock(m);
    messages.push_back(msg);
  });
  {
    WatchedCall quick("ncclCommInitRank of 'quick' (fake)", std::chrono::milliseconds(300));
  }
  {
    WatchedCall stuck("ncclCommInitRank of 'world' (fake nccl, rank 0/2)", std::chrono::milliseconds(300));
    std::this_thread::sleep_for(std::chrono::milliseconds(900));
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(400));  // the quick one, had it stayed watched
  Watchdog::instance().set_timeout_handler_for_testing(nullptr);
  std::lock_guard<std::mutex> lock(m);
  ASSERT_EQ(messages.size(), 1u);
  EXPECT_NE(messages[0].find("collective timeout: ncclCommInitRank of 'world' (fake nccl, rank 0/2) did not complete "
                             "within 0.3 s"),
            std::string::npos)
      << messages[0];
}

}  // namespace
}  // namespace dtrain::dist
