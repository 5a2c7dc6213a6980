// The communicator's memory contract (communicator.h, "Memory"), checked alike on every backend:
// a backend holds the tensors it was given until the operation completes, so the caller may drop
// its last reference at once, also inside a group before end_group() (NCCL launches a group only
// then: a send's buffer freed before could be handed by the caching allocator to the receive of
// the same group). Each case drops the caller's references, watches the storage through a weak
// reference, checks the result against a closed form, and that the backend lets go after the
// operation completed. The unit tests run them on the local backend, the MPI tests on the MPI
// backend, the GPU tests on NCCL (and local) with CUDA tensors.
#pragma once

#include <gtest/gtest.h>

#include <chrono>
#include <functional>
#include <thread>

#include <ATen/ATen.h>
#include <c10/util/intrusive_ptr.h>

#include "dtrain/dist/communicator.h"

namespace dtrain::dist::contract_cases {

using WeakStorage = c10::weak_intrusive_ptr<c10::StorageImpl>;

inline WeakStorage weak_storage(const at::Tensor& t) { return t.storage().getWeakStorageImpl(); }

// Whether the storage is freed within `limit` (a backend may let go a little after completion:
// the watchdog's next poll, an executor's cleanup).
inline bool released_within(const WeakStorage& weak, std::chrono::seconds limit = std::chrono::seconds(10)) {
  const auto until = std::chrono::steady_clock::now() + limit;
  while (!weak.expired()) {
    if (std::chrono::steady_clock::now() > until) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return true;
}

// Rank r's message: 0, 1, ..., len - 1, plus 1000 r (exact in float32).
inline at::Tensor message(int r, int64_t len, c10::Device device) {
  return at::arange(len, at::TensorOptions().dtype(at::kFloat).device(device)) + 1000.0 * r;
}

struct Hooks {
  // Optional: called just before an operation is issued, to hold its completion back (a long
  // kernel queued on the current stream of a GPU). The operation is then known to be
  // incomplete right after the call, and the storage must be alive there.
  std::function<void()> delay;
  // Optional, with two or more ranks: a second communicator over the same ranks. Every rank but
  // 0 issues the all-reduce only after rank 0 has checked its own, still incomplete one.
  Communicator* gate = nullptr;
};

// all_reduce(input, output) out of place, the caller dropping the input at once: the input stays
// alive until the operation completes; the output is the closed form.
inline void check_all_reduce_holds_a_dropped_input(Communicator& c, c10::Device device, const Hooks& hooks = {}) {
  SCOPED_TRACE(std::string(c.backend()) + " all_reduce, " + device.str());
  const int n = c.size(), r = c.rank();
  const int64_t len = int64_t{1} << 16;
  at::Tensor out = at::zeros({len}, at::TensorOptions().dtype(at::kFloat).device(device));
  const bool gated = hooks.gate && n > 1;
  if (gated && r != 0) hooks.gate->barrier()->wait();  // after rank 0's checks
  if (hooks.delay) hooks.delay();
  at::Tensor in = message(r, len, device);
  const WeakStorage weak = weak_storage(in);
  WorkPtr work = c.all_reduce(in, out, ReduceOp::kSum);
  in.reset();  // the caller's last reference to the input
  const bool pending = hooks.delay || (gated && r == 0);  // the operation cannot have completed yet
  if (pending) {
    EXPECT_FALSE(work->is_completed()) << "the operation completed before its peers or its stream got to it";
    EXPECT_FALSE(weak.expired()) << "the input was freed while the operation was still to run";
  } else if (weak.expired()) {
    EXPECT_TRUE(work->is_completed()) << "the input was freed before the operation completed";
  }
  if (gated && r == 0) hooks.gate->barrier()->wait();
  work->synchronize();
  const at::Tensor want = at::arange(len, at::kFloat) * n + 1000.0 * n * (n - 1) / 2;
  EXPECT_TRUE(at::equal(out.cpu(), want)) << "the all-reduce of inputs the caller dropped";
  EXPECT_TRUE(released_within(weak)) << "the backend still holds the input after the operation completed";
}

// A send to the next rank (to itself at one rank) and a receive from the previous one in one
// group, the caller dropping the sent tensor before the group is closed, as the pipeline's
// exchanges do. `launches_at_close`: the backend launches a group at end_group() (NCCL), so
// before the close the send has surely not completed and its tensor must be alive. The receive
// buffer, allocated after the drop with the send's size, is where a caching allocator would hand
// the freed block.
inline void check_group_holds_a_send_dropped_before_close(Communicator& c, c10::Device device,
                                                          bool launches_at_close) {
  SCOPED_TRACE(std::string(c.backend()) + " send and recv in a group, " + device.str());
  const int n = c.size(), r = c.rank();
  const int next = (r + 1) % n, prev = (r + n - 1) % n;
  const int64_t len = int64_t{1} << 16;
  at::Tensor out = message(r, len, device);
  const WeakStorage weak = weak_storage(out);
  WorkPtr sent, received;
  at::Tensor in;
  {
    CommGroup group(c);
    sent = c.send(out, next);
    out.reset();  // the caller's last reference to the sent tensor, before the group is launched
    if (launches_at_close) {
      EXPECT_FALSE(weak.expired()) << "the sent tensor was freed before its group was launched";
    } else if (weak.expired()) {
      EXPECT_TRUE(sent->is_completed()) << "the sent tensor was freed before the send completed";
    }
    in = at::full({len}, -1.0f, at::TensorOptions().device(device));
    received = c.recv(in, prev);
    group.close();
  }
  if (weak.expired()) EXPECT_TRUE(sent->is_completed()) << "the sent tensor was freed before the send completed";
  sent->wait();
  received->wait();
  EXPECT_TRUE(at::equal(in.cpu(), message(prev, len, c10::Device(c10::kCPU)))) << "the message from rank " << prev;
  sent->synchronize();
  EXPECT_TRUE(released_within(weak)) << "the backend still holds the sent tensor after the send completed";
}

}  // namespace dtrain::dist::contract_cases
