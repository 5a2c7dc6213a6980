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

TEST(Registry, AutoChoosesMpiWhenRanksShareAGpu) {
  World w;
  w.size = 4;
  w.local_size = 2;  // two ranks on this node
  EXPECT_EQ(choose_backend("auto", w, /*cuda_device=*/true, /*gpu_count=*/2, true), "nccl");
  EXPECT_EQ(choose_backend("auto", w, true, 1, true), "mpi");  // the one-GPU machine
  EXPECT_EQ(choose_backend("auto", w, true, 2, /*have_nccl=*/false), "mpi");
  EXPECT_EQ(choose_backend("auto", w, /*cuda_device=*/false, 0, true), "mpi");
  EXPECT_EQ(choose_backend("auto", World{}, false, 0, true), "local");
  EXPECT_EQ(choose_backend("mpi", w, true, 1, true), "mpi");
  try {
    choose_backend("nccl", w, true, 1, true);
    FAIL() << "nccl with two ranks on one GPU";
  } catch (const Error& e) {
    std::string m = e.what();
    EXPECT_NE(m.find("2 ranks on this node share 1 GPU(s)"), std::string::npos) << m;
    EXPECT_NE(m.find("--backend=mpi"), std::string::npos) << m;
  }
  EXPECT_THROW(choose_backend("nccl", w, true, 2, /*have_nccl=*/false), Error);
}

TEST(Registry, NonPositiveTimeoutIsRejected) {
  CommOptions o;
  o.timeout = std::chrono::milliseconds(0);
  EXPECT_THROW(create_communicator("local", World{}, c10::Device(c10::kCPU), o), Error);
}

TEST(Watchdog, ReportsAnOperationThatOutlivesItsTimeout) {
  std::mutex m;
  std::condition_variable cv;
  std::string message;
  bool aborted = false;
  Watchdog::instance().set_timeout_handler_for_testing([&](const std::string& msg) {
    std::lock_guard<std::mutex> lock(m);
    message = msg;
    cv.notify_all();
  });
  uint64_t token = Watchdog::instance().watch(
      {"all_reduce #42 on 'world' (fake)", std::chrono::milliseconds(300), [] { return false; },
       [&] { aborted = true; }});
  {
    std::unique_lock<std::mutex> lock(m);
    cv.wait_for(lock, std::chrono::seconds(5), [&] { return !message.empty(); });
  }
  Watchdog::instance().unwatch(token);
  Watchdog::instance().set_timeout_handler_for_testing(nullptr);
  EXPECT_NE(message.find("collective timeout: all_reduce #42 on 'world'"), std::string::npos) << message;
  EXPECT_NE(message.find("0.3 s"), std::string::npos) << message;
}

// A completion check that throws (a sticky CUDA error in an event query) must not take the
// watchdog thread down: the operation is reported at its timeout like any other.
TEST(Watchdog, ACompletionCheckThatThrowsEndsInTheTimeout) {
  std::mutex m;
  std::condition_variable cv;
  std::string message;
  Watchdog::instance().set_timeout_handler_for_testing([&](const std::string& msg) {
    std::lock_guard<std::mutex> lock(m);
    message = msg;
    cv.notify_all();
  });
  uint64_t token = Watchdog::instance().watch(
      {"all_reduce #7 on 'gpu' (fake)", std::chrono::milliseconds(300),
       []() -> bool { throw std::runtime_error("CUDA error: an illegal memory access"); },
       nullptr});
  {
    std::unique_lock<std::mutex> lock(m);
    cv.wait_for(lock, std::chrono::seconds(5), [&] { return !message.empty(); });
  }
  Watchdog::instance().unwatch(token);
  Watchdog::instance().set_timeout_handler_for_testing(nullptr);
  EXPECT_NE(message.find("collective timeout: all_reduce #7 on 'gpu'"), std::string::npos) << message;
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

}  // namespace
}  // namespace dtrain::dist
