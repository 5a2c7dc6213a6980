// The capped host memory pool: accounting, the cap and machine checks (before any memory is
// taken), messages that name the fix, and concurrent use.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <mutex>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "dtrain/dist/error.h"
#include "dtrain/offload/page_locked.h"
#include "dtrain/offload/pinned_pool.h"
#include "test_util.h"

namespace dtrain::offload {
namespace {

constexpr int64_t kMiB = int64_t{1} << 20;

// A /proc/meminfo-format file claiming `available_kb` kB available; removed at scope exit.
class FakeMeminfo {
 public:
  explicit FakeMeminfo(int64_t available_kb) {
    char name[] = "/tmp/dtrain_meminfo_XXXXXX";
    const int fd = mkstemp(name);
    EXPECT_GE(fd, 0);
    close(fd);
    path_ = name;
    std::ofstream out(path_);
    out << "MemTotal:       98765432 kB\nMemFree:          123456 kB\nMemAvailable:   "
        << available_kb << " kB\nBuffers:           1000 kB\n";
  }
  ~FakeMeminfo() { std::remove(path_.c_str()); }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

using testing_util::error_of;

// A page locker without a GPU: ordinary aligned memory, each block's size recorded, releases
// counted, and a failure on demand. It stands in for the CUDA runtime's cudaHostAlloc path.
class FakeLocker final : public HostPageLocker {
 public:
  void* allocate(int64_t bytes) override {
    if (fail) throw Error("fake locker: cannot lock " + std::to_string(bytes) + " bytes");
    void* p = std::aligned_alloc(64, static_cast<size_t>((bytes + 63) / 64 * 64));
    std::lock_guard<std::mutex> lock(mutex);
    live[p] = bytes;
    ++allocations;
    return p;
  }
  void release(void* p) noexcept override {
    std::lock_guard<std::mutex> lock(mutex);
    released_sizes.push_back(live.count(p) ? live[p] : -1);  // -1: not one of ours
    live.erase(p);
    std::free(p);
  }
  bool fail = false;
  std::mutex mutex;
  std::map<void*, int64_t> live;
  std::vector<int64_t> released_sizes;
  int allocations = 0;
};

TEST(PageLocked, FootprintIsThePagesOfALargeRequestAndAPowerOfTwoOfASmallOne) {
  EXPECT_EQ(page_locked_footprint(3000), 4096);          // PyTorch's cache: a power of two
  EXPECT_EQ(page_locked_footprint(9 * kMiB), 16 * kMiB);  // still under the exact threshold
  EXPECT_EQ(page_locked_footprint(kExactPinMinBytes), kExactPinMinBytes);
  // 40 GiB of streamed weights take 40 GiB and a page, not the 64 GiB of the next power of two.
  EXPECT_EQ(page_locked_footprint((int64_t{40} << 30) + 1), (int64_t{40} << 30) + 4096);
  EXPECT_EQ(page_locked_footprint(6000000, kMiB), 1465 * 4096);  // pages, rounded up
}

TEST(PageLocked, ALargeRequestIsLockedAtItsExactSizeAndReturnedWithItsLastView) {
  auto locker = std::make_shared<FakeLocker>();
  at::Tensor view;
  {
    at::Tensor t = page_locked_empty({5, 300000}, at::kFloat, locker, kMiB);
    ASSERT_EQ(locker->allocations, 1);
    EXPECT_EQ(locker->live.begin()->second, 6000000) << "exactly the tensor's bytes, no rounding";
    EXPECT_EQ(t.data_ptr(), locker->live.begin()->first);
    EXPECT_EQ(t.sizes(), (std::vector<int64_t>{5, 300000}));
    EXPECT_EQ(t.scalar_type(), at::kFloat);
    EXPECT_TRUE(t.is_cpu() && t.is_contiguous());
    t.fill_(0.5f);
    EXPECT_EQ(t.sum().item<double>(), 750000.0);
    view = t.narrow(1, 10, 4);
  }
  EXPECT_TRUE(locker->released_sizes.empty()) << "a view keeps the block";
  EXPECT_EQ(view.sum().item<float>(), 10.0f);
  view = at::Tensor();
  EXPECT_EQ(locker->released_sizes, (std::vector<int64_t>{6000000})) << "returned once, when the last view died";
  EXPECT_TRUE(locker->live.empty());
}

TEST(PageLocked, WithoutADeviceOrWhenLockingFailsItSaysSo) {
  std::string msg = error_of([] { page_locked_empty({4 * kMiB}, at::kFloat, nullptr, kMiB); });
  EXPECT_NE(msg.find("needs a CUDA device"), std::string::npos) << msg;
  auto locker = std::make_shared<FakeLocker>();
  locker->fail = true;
  msg = error_of([&] { page_locked_empty({4 * kMiB}, at::kFloat, locker, kMiB); });
  EXPECT_NE(msg.find("cannot lock 16777216 bytes"), std::string::npos) << msg;
  EXPECT_TRUE(locker->live.empty());
  EXPECT_TRUE(locker->released_sizes.empty());
}

// The pool's large pinned blocks take their pages, not a power of two: 5 MiB + 1 byte under a
// 6 MiB cap fits (PyTorch's cache would take 8 MiB and be refused), is charged its pages, and
// is uncharged and returned when its last view dies, also after the pool is gone.
TEST(OffloadPinnedPool, LargePinnedBlocksAreChargedTheirPagesNotAPowerOfTwo) {
  auto locker = std::make_shared<FakeLocker>();
  PinnedPoolOptions options;
  options.page_locker = locker;
  options.exact_pin_min_bytes = 1;  // every request exact: the small ones' cache needs CUDA
  options.limit_bytes = 6 * kMiB;
  at::Tensor kept;
  {
    PinnedPool pool(options);
    EXPECT_TRUE(pool.pinned()) << "a locker of the test's own pins without a device";
    const int64_t bytes = 5 * kMiB + 1;
    EXPECT_EQ(pool.charged_bytes(bytes), 5 * kMiB + 4096);
    at::Tensor a = pool.allocate(bytes);
    EXPECT_EQ(a.numel(), bytes);
    ASSERT_EQ(locker->allocations, 1);
    EXPECT_EQ(locker->live.begin()->second, bytes);
    EXPECT_EQ(pool.used_bytes(), 5 * kMiB + 4096);
    a.fill_(1);
    EXPECT_EQ(a.sum().item<int64_t>(), bytes);
    // Over the cap: refused before the locker is asked.
    const std::string msg = error_of([&] { pool.allocate(kMiB); });
    EXPECT_NE(msg.find("cap is in use"), std::string::npos) << msg;
    EXPECT_EQ(locker->allocations, 1);
    a = at::Tensor();
    EXPECT_EQ(pool.used_bytes(), 0);
    EXPECT_EQ(locker->released_sizes, (std::vector<int64_t>{bytes}));
    // A failure of the locker: a clear error, nothing charged.
    locker->fail = true;
    const std::string failed = error_of([&] { pool.allocate(2 * kMiB); });
    EXPECT_NE(failed.find("pinned host pool: allocating 2.00 MiB (2097152 bytes) of pinned host memory failed"),
              std::string::npos)
        << failed;
    EXPECT_NE(failed.find("fake locker: cannot lock 2097152 bytes"), std::string::npos) << failed;
    EXPECT_EQ(pool.used_bytes(), 0);
    locker->fail = false;
    kept = pool.allocate(1000, at::kFloat);
    EXPECT_EQ(pool.used_bytes(), 4096);
  }
  kept.fill_(2.0f);  // outlives the pool
  EXPECT_EQ(kept.sum().item<float>(), 2000.0f);
  kept = at::Tensor();
  EXPECT_TRUE(locker->live.empty());
  EXPECT_EQ(locker->released_sizes.size(), 2u);
}

TEST(OffloadPinnedPool, AllocatesAndAccounts) {
  PinnedPool pool;
  EXPECT_EQ(pool.pinned(), at::hasCUDA());
  if (!pool.pinned()) {
    std::printf("[ note ] no CUDA device: the pool hands out ordinary (pageable) host memory\n");
  }
  {
    at::Tensor a = pool.allocate(1000);
    EXPECT_EQ(a.scalar_type(), at::kByte);
    EXPECT_EQ(a.numel(), 1000);
    EXPECT_TRUE(a.is_cpu());
    EXPECT_EQ(reinterpret_cast<uintptr_t>(a.data_ptr()) % 64, 0u);
    if (pool.pinned()) EXPECT_TRUE(a.is_pinned());
    EXPECT_EQ(pool.used_bytes(), pool.charged_bytes(1000));
    at::Tensor f = pool.allocate(300, at::kFloat);
    EXPECT_EQ(f.scalar_type(), at::kFloat);
    EXPECT_EQ(f.numel(), 300);
    f.fill_(2.5f);  // usable memory
    EXPECT_EQ(f.sum().item<float>(), 750.0f);
    EXPECT_EQ(pool.used_bytes(), pool.charged_bytes(1000) + pool.charged_bytes(1200));
    // A view keeps the memory (and its charge) alive after the original handle is gone.
    at::Tensor view = f.narrow(0, 10, 5);
    f = at::Tensor();
    EXPECT_EQ(pool.used_bytes(), pool.charged_bytes(1000) + pool.charged_bytes(1200));
    EXPECT_EQ(view.sum().item<float>(), 12.5f);
  }
  EXPECT_EQ(pool.used_bytes(), 0);
  EXPECT_EQ(pool.peak_bytes(), pool.charged_bytes(1000) + pool.charged_bytes(1200));
  // Pageable memory is charged as asked; small pinned blocks as the power of two PyTorch takes.
  EXPECT_EQ(pool.charged_bytes(3000), pool.pinned() ? 4096 : 3000);
}

// Large pageable blocks get a huge-page hint; they are ordinary memory all the same.
TEST(OffloadPinnedPool, LargeAllocationsAreUsable) {
  for (bool huge : {true, false}) {
    PinnedPoolOptions options;
    options.huge_pages = huge;
    PinnedPool pool(options);
    at::Tensor t = pool.allocate(9 * kMiB / 4, at::kFloat);
    t.fill_(3.0f);
    EXPECT_EQ(t.sum().item<double>(), 3.0 * t.numel());
    EXPECT_EQ(pool.used_bytes(), pool.charged_bytes(9 * kMiB));
  }
}

// Pageable arrays (the CPU optimizer's master and moments): never page-locked, charged exactly
// and under the same cap as the pinned blocks beside them.
TEST(OffloadPinnedPool, PageableArraysAreChargedExactlyUnderTheSameCap) {
  PinnedPoolOptions options;
  options.limit_bytes = 2 * kMiB;
  PinnedPool pool(options);
  at::Tensor pinned = pool.allocate(3000);
  const int64_t pinned_charge = pool.charged_bytes(3000);
  {
    at::Tensor master = pool.allocate_pageable(300, at::kFloat);
    EXPECT_FALSE(master.is_pinned());
    EXPECT_EQ(master.scalar_type(), at::kFloat);
    EXPECT_EQ(master.numel(), 300);
    EXPECT_EQ(pool.used_bytes(), pinned_charge + 1200);  // 1200 even where pinning would take 2048
    master.fill_(1.5f);
    EXPECT_EQ(master.sum().item<float>(), 450.0f);
    const std::string msg = error_of([&] { pool.allocate_pageable(kMiB / 2, at::kFloat); });
    EXPECT_NE(msg.find("cannot allocate 2.00 MiB (2097152 bytes) of host memory"), std::string::npos) << msg;
    EXPECT_NE(msg.find("--host_mem_limit_gb"), std::string::npos) << msg;
    EXPECT_EQ(pool.used_bytes(), pinned_charge + 1200);  // the refused request charged nothing
  }
  EXPECT_EQ(pool.used_bytes(), pinned_charge);
  EXPECT_NE(error_of([&] { pool.allocate_pageable(0, at::kFloat); }).find("at least 1 element"), std::string::npos);
}

TEST(OffloadPinnedPool, MemoryOutlivesThePool) {
  at::Tensor t;
  {
    PinnedPool pool;
    t = pool.allocate(64, at::kFloat);
  }
  t.fill_(1.0f);  // the storage (and the pool's accounting state) are still alive
  EXPECT_EQ(t.sum().item<float>(), 64.0f);
}

TEST(OffloadPinnedPool, CapIsCheckedBeforeAllocating) {
  PinnedPoolOptions options;
  options.limit_bytes = 1 * kMiB;
  PinnedPool pool(options);
  const int64_t part = pool.pinned() ? 256 * 1024 : 400 * 1024;
  at::Tensor a = pool.allocate(part);
  at::Tensor b = pool.allocate(part);
  const int64_t used = pool.used_bytes();
  const std::string msg = error_of([&] { pool.allocate(600 * 1024); });
  EXPECT_NE(msg.find("--host_mem_limit_gb"), std::string::npos) << msg;
  EXPECT_NE(msg.find("cap"), std::string::npos) << msg;
  EXPECT_NE(msg.find("(" + std::to_string(pool.charged_bytes(600 * 1024)) + " bytes)"),
            std::string::npos)
      << "names the request: " << msg;
  EXPECT_NE(msg.find("(" + std::to_string(used) + " bytes)"), std::string::npos)
      << "names what is in use: " << msg;
  EXPECT_NE(msg.find("(" + std::to_string(kMiB) + " bytes)"), std::string::npos)
      << "names the cap: " << msg;
  EXPECT_EQ(pool.used_bytes(), used) << "a refused request charges nothing";
  // Freeing makes room again.
  a = at::Tensor();
  EXPECT_NO_THROW(pool.allocate(part));
}

TEST(OffloadPinnedPool, NamesTheConfiguredFlag) {
  PinnedPoolOptions options;
  options.limit_bytes = 1024;
  options.limit_flag = "--layer_host_mem_gb";
  PinnedPool pool(options);
  const std::string msg = error_of([&] { pool.allocate(4096); });
  EXPECT_NE(msg.find("--layer_host_mem_gb"), std::string::npos) << msg;
}

TEST(OffloadPinnedPool, RefusesBeyondMemAvailable) {
  FakeMeminfo meminfo(10 * 1024);  // 10 MiB available
  PinnedPoolOptions options;
  options.meminfo_path = meminfo.path();
  options.min_free_bytes = 4 * kMiB;
  PinnedPool pool(options);  // no cap of its own
  EXPECT_NO_THROW(pool.allocate(4 * kMiB));
  const std::string msg = error_of([&] { pool.allocate(7 * kMiB); });
  EXPECT_NE(msg.find("MemAvailable"), std::string::npos) << msg;
  EXPECT_NE(msg.find(meminfo.path()), std::string::npos) << msg;
  EXPECT_NE(msg.find("(" + std::to_string(10 * kMiB) + " bytes) available"), std::string::npos)
      << msg;
  EXPECT_NE(msg.find("kept free"), std::string::npos) << msg;
}

TEST(OffloadPinnedPool, WithoutMeminfoOnlyTheCapCounts) {
  PinnedPoolOptions options;
  options.meminfo_path = "/nonexistent/meminfo";
  options.limit_bytes = 2 * kMiB;
  PinnedPool pool(options);
  at::Tensor held = pool.allocate(kMiB);
  EXPECT_THROW(pool.allocate(2 * kMiB), Error);
}

TEST(OffloadPinnedPool, ReadsMemAvailable) {
  const int64_t available = read_mem_available();
  EXPECT_GT(available, 0) << "this Linux machine has /proc/meminfo";
  FakeMeminfo meminfo(12345);
  EXPECT_EQ(read_mem_available(meminfo.path()), 12345 * 1024);
  EXPECT_EQ(read_mem_available("/nonexistent/meminfo"), -1);
}

TEST(OffloadPinnedPool, BadInput) {
  PinnedPool pool;
  EXPECT_NE(error_of([&] { pool.allocate(0); }).find("at least 1 byte"), std::string::npos);
  EXPECT_THROW(pool.allocate(-5), Error);
  EXPECT_THROW(pool.allocate(0, at::kFloat), Error);
  PinnedPoolOptions bad;
  bad.limit_bytes = -1;
  EXPECT_NE(error_of([&] { PinnedPool p(bad); }).find("--host_mem_limit_gb"), std::string::npos);
  EXPECT_EQ(host_limit_bytes_from_gb(0.0), 0);
  EXPECT_EQ(host_limit_bytes_from_gb(0.5), 512 * kMiB);
  EXPECT_EQ(host_limit_bytes_from_gb(125), int64_t{125} << 30);
  const std::string msg = error_of([] { host_limit_bytes_from_gb(-2.0); });
  EXPECT_NE(msg.find("--host_mem_limit_gb=-2"), std::string::npos) << msg;
  EXPECT_THROW(host_limit_bytes_from_gb(std::nan("")), Error);
}

// Several threads allocate and free at once: the cap holds at every moment (peak), refused
// requests charge nothing, and everything is uncharged at the end.
TEST(OffloadPinnedPool, ConcurrentUseRespectsTheCap) {
  PinnedPoolOptions options;
  options.limit_bytes = 64 * 1024;
  PinnedPool pool(options);
  std::atomic<int> refused{0}, granted{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      std::vector<at::Tensor> held;
      for (int i = 0; i < 200; ++i) {
        const int64_t bytes = 512 + ((i * 7 + t * 13) % 16) * 512;
        try {
          held.push_back(pool.allocate(bytes));
          granted.fetch_add(1);
        } catch (const Error&) {
          refused.fetch_add(1);
        }
        if (held.size() > 3) held.erase(held.begin());
      }
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_GT(granted.load(), 0);
  EXPECT_LE(pool.peak_bytes(), options.limit_bytes);
  EXPECT_EQ(pool.used_bytes(), 0);
}

}  // namespace
}  // namespace dtrain::offload
