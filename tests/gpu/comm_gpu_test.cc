// Collectives on CUDA tensors: NCCL at world size 1 (or more, one GPU per rank), and MPI
// staged through pinned host memory with several ranks sharing one GPU.
#include <gtest/gtest.h>

#include <optional>

#include <ATen/ATen.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include "../../dist/src/teardown.h"
#include "comm_contract_cases.h"
#include "device_work.h"
#include "dtrain/dist/communicator.h"
#include "dtrain/dist/error.h"
#include "dtrain/dist/world.h"
#include "test_util.h"

namespace dtrain::dist {
namespace {

void check_all_collectives(Communicator& c, c10::Device dev) {
  const int N = c.size(), r = c.rank();
  auto opts = at::TensorOptions().device(dev);
  for (at::ScalarType t : {at::kFloat, at::kDouble, at::kHalf, at::kBFloat16, at::kLong}) {
    for (int64_t n : {int64_t{0}, int64_t{1}, int64_t{1001}, int64_t{4} << 20}) {
      at::Tensor p = at::remainder(at::arange(n, at::kLong), 7).to(at::kDouble);
      at::Tensor x = (p + (r + 1)).to(opts.dtype(t));
      c.all_reduce(x)->wait();
      EXPECT_TRUE(at::equal(x.cpu().to(at::kDouble), p * N + N * (N + 1) / 2.0)) << c10::toString(t) << " n=" << n;
      at::Tensor y = (p + (r + 1)).to(opts.dtype(t));
      at::Tensor out = at::empty_like(y);
      if (at::isFloatingType(t)) {
        c.all_reduce(y, out, ReduceOp::kAvg)->wait();
        EXPECT_TRUE(at::equal(out.cpu().to(at::kDouble), p + (N + 1) / 2.0));
      }
      at::Tensor g = at::empty({N * n}, opts.dtype(t));
      c.all_gather((p + 10 * r).to(opts.dtype(t)), g)->wait();
      for (int j = 0; j < N && n > 0; ++j) {
        EXPECT_TRUE(at::equal(g.narrow(0, j * n, n).cpu().to(at::kDouble), p + 10 * j));
      }
      at::Tensor in = at::cat(std::vector<at::Tensor>(N, p)).to(opts.dtype(t));
      at::Tensor rs = at::empty({n}, opts.dtype(t));
      c.reduce_scatter(in, rs)->wait();
      EXPECT_TRUE(at::equal(rs.cpu().to(at::kDouble), p * N));
      at::Tensor red = (p + (r + 1)).to(opts.dtype(t));
      c.reduce(red, N - 1)->wait();
      if (r == N - 1) EXPECT_TRUE(at::equal(red.cpu().to(at::kDouble), p * N + N * (N + 1) / 2.0));
      at::Tensor b = (p + r).to(opts.dtype(t));
      c.broadcast(b, N - 1)->wait();
      EXPECT_TRUE(at::equal(b.cpu().to(at::kDouble), p + (N - 1)));
    }
  }
  // Multi-dimensional tensors (the tensor-parallel layers all-reduce [B, T, d] activations).
  at::Tensor p3 = at::remainder(at::arange(2 * 3 * 5, at::kLong), 7).to(at::kDouble).view({2, 3, 5});
  at::Tensor x3 = (p3 + (r + 1)).to(opts.dtype(at::kFloat));
  c.all_reduce(x3)->wait();
  EXPECT_TRUE(at::equal(x3.cpu().to(at::kDouble), p3 * N + N * (N + 1) / 2.0));
  at::Tensor o3 = at::empty_like(x3);
  c.all_reduce((p3 + r).to(opts.dtype(at::kFloat)), o3, ReduceOp::kMax)->wait();
  EXPECT_TRUE(at::equal(o3.cpu().to(at::kDouble), p3 + (N - 1)));
  at::Tensor b3 = (p3 + r).to(opts.dtype(at::kFloat));
  c.broadcast(b3, 0)->wait();
  EXPECT_TRUE(at::equal(b3.cpu().to(at::kDouble), p3));
  at::Tensor g3 = at::empty({N * 2, 3, 5}, opts.dtype(at::kFloat));
  c.all_gather((p3 + 10 * r).to(opts.dtype(at::kFloat)), g3)->wait();
  for (int j = 0; j < N; ++j) {
    EXPECT_TRUE(at::equal(g3.narrow(0, 2 * j, 2).cpu().to(at::kDouble), p3 + 10 * j));
  }
  at::Tensor rs3 = at::empty({2, 3, 5}, opts.dtype(at::kFloat));
  c.reduce_scatter(at::cat(std::vector<at::Tensor>(N, p3)).to(opts.dtype(at::kFloat)), rs3)->wait();
  EXPECT_TRUE(at::equal(rs3.cpu().to(at::kDouble), p3 * N));
  c.barrier()->wait();
}

// select_device() makes this rank's GPU the thread's current device, so "current device"
// fallbacks (an unindexed CUDA device, memory statistics, NVML status) mean this rank's GPU.
TEST(GpuDevice, SelectDeviceMakesTheRanksGpuCurrent) {
  DTRAIN_SKIP_WITHOUT_CUDA();
  const World& w = testing_util::world();
  const c10::Device d = select_device(w, DeviceRequest::kCuda);
  EXPECT_EQ(d.index(), w.local_rank % static_cast<int>(c10::impl::getDeviceGuardImpl(c10::kCUDA)->deviceCount()));
  EXPECT_EQ(c10::impl::getDeviceGuardImpl(c10::kCUDA)->getDevice().index(), d.index());
}

// The local backend's Work orders a consumer on another stream after the issuing stream: a
// gradient still being computed when the collective is issued is complete once wait() returns
// on the consumer's stream (issue 19, item 1). The producer runs long enough (a chain of
// kernels on 64 MiB) that an unordered read on the other stream would see a partial result.
TEST(GpuCollectives, LocalWorkOrdersTheWaitingStreamAfterTheIssuingStream) {
  DTRAIN_SKIP_WITHOUT_CUDA();
  const c10::Device dev(c10::kCUDA, 0);
  auto c = create_communicator("local", World{}, dev);
  c10::impl::VirtualGuardImpl impl(c10::kCUDA);
  const c10::Stream producer = impl.getStreamFromGlobalPool(dev, /*isHighPriority=*/false);
  const c10::Stream consumer = impl.getStreamFromGlobalPool(dev, /*isHighPriority=*/false);
  const int64_t n = int64_t{16} << 20;
  for (int trial = 0; trial < 3; ++trial) {
    at::Tensor x, out, read;
    {
      c10::StreamGuard on(producer);
      x = at::zeros({n}, at::TensorOptions().device(dev));
      for (int k = 0; k < 200; ++k) x.add_(1.0);
      out = at::empty_like(x);
      WorkPtr work = c->all_reduce(x, out, ReduceOp::kSum);
      c10::StreamGuard other(consumer);
      work->wait();
      read = out.clone();
      impl.recordDataPtrOnStream(out.storage().data_ptr(), consumer);
    }
    impl.synchronizeStream(consumer);
    impl.synchronizeStream(producer);
    EXPECT_EQ(read.min().item<double>(), 200.0) << "trial " << trial;
    EXPECT_EQ(read.max().item<double>(), 200.0) << "trial " << trial;
  }
}

// This rank's GPU for `backend` ("mpi" or "nccl"), or nullopt (with the reason in *why) where
// that backend cannot run here: every backend needs a CUDA GPU; MPI needs mpirun (gpu.mpi.np2)
// and lets the ranks share the single GPU; NCCL needs a build with it and one GPU per rank.
std::optional<c10::Device> backend_device(const std::string& backend, std::string* why) {
  const World& w = testing_util::world();
  auto names = available_backends();
  const int gpus = testing_util::has_cuda()
                       ? static_cast<int>(c10::impl::getDeviceGuardImpl(c10::kCUDA)->deviceCount())
                       : 0;
  if (gpus == 0) {
    *why = "no CUDA GPU here";
  } else if (backend == "mpi") {
    if (w.has_mpi_launcher() || w.size > 1) return c10::Device(c10::kCUDA, 0);
    *why = "run under mpirun for the MPI backend";
  } else if (std::find(names.begin(), names.end(), "nccl") == names.end()) {
    *why = "built without NCCL";
  } else if (w.size > gpus) {
    *why = "NCCL needs one GPU per rank (" + std::to_string(w.size) + " ranks, " + std::to_string(gpus) + " GPUs)";
  } else {
    return c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(w.local_rank % gpus));
  }
  return std::nullopt;
}

// check(communicator, device) on `backend`'s communicator of the world on this rank's GPU; the
// calling test skips (visibly) where the backend cannot run here.
void check_on_backend(const std::string& backend, void (*check)(Communicator&, c10::Device)) {
  std::string why;
  const std::optional<c10::Device> dev = backend_device(backend, &why);
  if (!dev) GTEST_SKIP() << why;
  check(*create_communicator(backend, testing_util::world(), *dev), *dev);
}

TEST(GpuCollectives, MpiStagesCudaTensorsThroughPinnedMemory) { check_on_backend("mpi", check_all_collectives); }

TEST(GpuCollectives, NcclBackendAtThisWorldSize) {
  std::string why;
  const std::optional<c10::Device> dev = backend_device("nccl", &why);
  if (!dev) GTEST_SKIP() << why;
  auto c = create_communicator("nccl", testing_util::world(), *dev);
  check_all_collectives(*c, *dev);
  // CPU tensors travel over the partner communicator.
  at::Tensor cpu = at::full({3}, 1.0);
  c->all_reduce(cpu)->wait();
  EXPECT_EQ(cpu[0].item<double>(), testing_util::world().size);
  auto sub = c->split(0, testing_util::world().rank, "all");
  ASSERT_NE(sub, nullptr);
  check_all_collectives(*sub, *dev);
  // A host-only split makes no NCCL communicator: its partner's (MPI, local alone), for host tensors.
  auto host = c->split_host(0, testing_util::world().rank, "host");
  ASSERT_NE(host, nullptr);
  EXPECT_STRNE(host->backend(), "nccl");  // mpi, or local for a lone process
  EXPECT_EQ(host->size(), testing_util::world().size);
  at::Tensor flag = at::ones({1}, at::kLong);
  host->all_reduce(flag)->wait();
  EXPECT_EQ(flag.item<int64_t>(), testing_util::world().size);
}

// Send and receive of CUDA tensors: each rank sends to the next (itself at one rank) inside
// one group, as NCCL needs for a pair that must proceed together; the receive is usable on the
// caller's stream after wait(). MPI stages through host memory; NCCL runs ncclSend/ncclRecv.
void check_point_to_point(Communicator& c, c10::Device dev) {
  const int n = c.size(), r = c.rank();
  const int next = (r + 1) % n, prev = (r + n - 1) % n;
  for (int64_t len : {int64_t{7}, int64_t{1} << 22}) {
    at::Tensor out = at::arange(len, at::TensorOptions().dtype(at::kFloat).device(dev)) + 1000 * r;
    at::Tensor in = at::full({len}, -1.0f, at::TensorOptions().device(dev));
    WorkPtr sw, rw;
    {
      CommGroup group(c);
      sw = c.send(out, next);
      rw = c.recv(in, prev);
      group.close();
    }
    sw->wait();
    rw->wait();
    at::Tensor want = at::arange(len, at::kFloat) + 1000 * prev;
    EXPECT_TRUE(at::equal(in.cpu(), want)) << c.backend() << ", " << len << " elements";
  }
}

// One test per backend, each skipping visibly (not passing) where its backend cannot run here:
// MPI needs mpirun (gpu.mpi.np2); NCCL needs one GPU per rank, so on a one-GPU machine it runs
// at one rank only.
TEST(GpuPointToPoint, MpiSendsAndReceivesCudaTensors) { check_on_backend("mpi", check_point_to_point); }

TEST(GpuPointToPoint, NcclSendsAndReceivesCudaTensors) { check_on_backend("nccl", check_point_to_point); }

// Regression (NCCL's Works held no tensors, and the pipeline dropped a send's tensor before its
// group was launched at end_group(): the caching allocator could hand the freed block to the
// group's receive). On NCCL, tensors the caller dropped stay alive until their operation
// completes: an all-reduce's input while the all-reduce waits behind a long kernel, and a send
// to the next rank (oneself at one rank) dropped inside its group before the close, whose
// receive is allocated after the drop with the same size (comm_contract_cases.h). The local
// backend with CUDA tensors keeps the same contract.
TEST(GpuCommContract, NcclHoldsTensorsTheCallerDroppedUntilTheyComplete) {
  std::string why;
  const std::optional<c10::Device> mine = backend_device("nccl", &why);
  if (!mine) GTEST_SKIP() << why;
  auto nccl = create_communicator("nccl", testing_util::world(), *mine);
  contract_cases::Hooks hooks;
  hooks.delay = [&] { testing_util::queue_matmuls(*mine, 40); };
  contract_cases::check_all_reduce_holds_a_dropped_input(*nccl, *mine, hooks);
  // An idle NCCL stream: a block freed before the launch would be reusable at once.
  testing_util::synchronize_device(*mine);
  contract_cases::check_group_holds_a_send_dropped_before_close(*nccl, *mine, /*launches_at_close=*/true);
  if (testing_util::world().size == 1) {
    auto local = create_communicator("local", World{}, *mine);
    contract_cases::check_all_reduce_holds_a_dropped_input(*local, *mine);
    contract_cases::check_group_holds_a_send_dropped_before_close(*local, *mine, /*launches_at_close=*/false);
  }
}

// NCCL launches a group's operations at end_group(): waiting on one before is a dtrain::Error
// that says so, not a wait on an event never recorded (which returned at once, before any data).
TEST(GpuCommContract, NcclWaitOnAnOperationOfAnOpenGroupIsAnError) {
  std::string why;
  const std::optional<c10::Device> mine = backend_device("nccl", &why);
  if (!mine) GTEST_SKIP() << why;
  auto c = create_communicator("nccl", testing_util::world(), *mine);
  const int n = c->size(), r = c->rank(), next = (r + 1) % n, prev = (r + n - 1) % n;
  at::Tensor out = contract_cases::message(r, 1024, *mine);
  at::Tensor in = at::full({1024}, -1.0f, at::TensorOptions().device(*mine));
  CommGroup group(*c);
  WorkPtr sent = c->send(out, next), received = c->recv(in, prev);
  EXPECT_FALSE(received->is_completed());
  const std::string waited = testing_util::error_of([&] { received->wait(); });
  EXPECT_NE(waited.find("wait() on an operation of a group that is still open"), std::string::npos) << waited;
  EXPECT_NE(waited.find("call end_group()"), std::string::npos) << waited;
  const std::string synced = testing_util::error_of([&] { sent->synchronize(); });
  EXPECT_NE(synced.find("synchronize() on an operation of a group that is still open"), std::string::npos) << synced;
  group.close();
  sent->wait();
  received->wait();
  EXPECT_TRUE(at::equal(in.cpu(), contract_cases::message(prev, 1024, c10::Device(c10::kCPU))));
}

// Regression (the destructor always called ncclCommDestroy, which waits for the queued work: a
// peer that failed mid-operation made a rank block in it forever). A communicator destroyed with
// a collective still queued (behind a long kernel) is aborted, and its destructor returns; an
// idle one is destroyed. The path taken is counted (teardown_counts()) and an abort is logged.
TEST(GpuCommTeardown, NcclAbortsWithWorkQueuedAndDestroysWhenIdle) {
  std::string why;
  const std::optional<c10::Device> mine = backend_device("nccl", &why);
  if (!mine) GTEST_SKIP() << why;
  if (testing_util::world().size > 1) GTEST_SKIP() << "one rank (every rank would abort its side of a collective)";
  const TeardownCounts start = teardown_counts();
  {
    auto idle = create_communicator("nccl", testing_util::world(), *mine);
    at::Tensor x = at::ones({16}, at::TensorOptions().device(*mine));
    idle->all_reduce(x)->synchronize();
  }
  EXPECT_EQ(teardown_counts().destroyed, start.destroyed + 1) << "an idle communicator is destroyed";
  EXPECT_EQ(teardown_counts().aborted, start.aborted);
  WorkPtr queued;
  {
    auto busy = create_communicator("nccl", testing_util::world(), *mine);
    testing_util::queue_matmuls(*mine, 40);
    at::Tensor x = at::ones({16}, at::TensorOptions().device(*mine));
    queued = busy->all_reduce(x);
    EXPECT_FALSE(queued->is_completed()) << "the all-reduce runs after the matrix products";
  }  // returns (an abort does not wait for the collective)
  EXPECT_EQ(teardown_counts().aborted, start.aborted + 1) << "a communicator with work queued is aborted";
  EXPECT_EQ(teardown_counts().destroyed, start.destroyed + 1);
  testing_util::synchronize_device(*mine);
  queued.reset();
}

}  // namespace
}  // namespace dtrain::dist
