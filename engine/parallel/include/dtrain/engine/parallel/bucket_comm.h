// How the reducer averages one bucket of gradients (c10d's communication hook idea): every
// bucket goes through a BucketComm, so a new way to communicate gradients (reduce-scatter for
// sharded data parallelism, another compression) is one more class, not another branch in the
// reducer. The reducer copies the bucket's gradients into wire() before launch() (when they
// differ) and the wire's values back into the gradients after the works complete.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>

#include "dtrain/dist/communicator.h"

namespace dtrain::engine {

// The collectives of one bucket: every one must be waited for; `mine` completes when this
// rank's values of the bucket are final.
struct BucketLaunch {
  std::vector<dist::WorkPtr> works;
  dist::WorkPtr mine;
};

class BucketComm {
 public:
  virtual ~BucketComm() = default;
  // For the timeline and logs: "all_reduce", "reduce to owners".
  virtual std::string name() const = 0;
  // The tensor the communication reads and writes for a bucket whose gradients are `flat`
  // (made once per bucket when buckets are built). Default: flat itself.
  virtual at::Tensor wire(const at::Tensor& flat) const { return flat; }
  // Starts averaging one bucket over comm. wire holds this rank's gradients of elements
  // [flat_begin, flat_begin + wire.numel()) of the flat gradient space (the parameters end to
  // end; meaningful with consecutive_buckets()). Runs on autograd's thread under the reducer's
  // lock: only launch asynchronous collectives, never block.
  virtual BucketLaunch launch(const at::Tensor& wire, int64_t flat_begin, dist::Communicator& comm) = 0;
  // Buckets must hold consecutive parameters (one flat range each, launched last first) and
  // are never rebuilt in arrival order.
  virtual bool consecutive_buckets() const { return false; }
  // With consecutive_buckets(): the buckets exactly, as the parameter indices where each
  // begins (ascending, the first 0), whatever their bytes. Empty: cut by the reducer's sizes.
  virtual std::vector<size_t> bucket_starts() const { return {}; }
  // Elements of a bucket's storage for `numel` gradients: more when the collective wants the
  // bucket padded (the gradients are its first numel elements; the rest stays zero). wire()
  // then gets the whole storage.
  virtual int64_t storage_numel(int64_t numel) const { return numel; }
  // Whether the reducer keeps a bucket's averaged gradients. false: the strategy delivers the
  // results elsewhere (ZeRO-3's reduce-scatter into the optimizer's gradient shard), and the
  // reducer releases each bucket once its reduction completed (launching one bucket waits for
  // the one before it); after a synchronized backward every .grad is undefined.
  virtual bool keeps_gradients() const { return true; }
};

// Every rank gets every average (DDP's default).
class AllReduceBuckets : public BucketComm {
 public:
  std::string name() const override { return "all_reduce"; }
  BucketLaunch launch(const at::Tensor& wire, int64_t flat_begin, dist::Communicator& comm) override;
};

// Each gradient element is averaged only on the rank that owns it (ZeRO-2 style, for a
// partitioned optimizer; about half the bytes of an all-reduce): owned[r] = [begin, end) of
// the flat space owned by rank r. Elsewhere the gradients hold unspecified values. A bucket is
// reduced to each owner of a part of it.
class ReduceToOwnerBuckets : public BucketComm {
 public:
  // Throws dtrain::Error unless owned has one range per rank of a communicator of
  // comm_size ranks and the ranges cover [0, numel) exactly once (empty ranges allowed).
  ReduceToOwnerBuckets(std::vector<std::pair<int64_t, int64_t>> owned, int comm_size, int64_t numel);
  std::string name() const override { return "reduce to owners"; }
  BucketLaunch launch(const at::Tensor& wire, int64_t flat_begin, dist::Communicator& comm) override;
  bool consecutive_buckets() const override { return true; }

 private:
  std::vector<std::pair<int64_t, int64_t>> owned_;
};

// Another strategy over a compressed copy of each bucket (bfloat16 or float16: half the bytes);
// results are written back in the gradients' dtype.
class CompressedBuckets : public BucketComm {
 public:
  // Throws dtrain::Error for a dtype other than bfloat16 or float16.
  CompressedBuckets(std::unique_ptr<BucketComm> inner, at::ScalarType dtype);
  std::string name() const override { return inner_->name(); }
  at::Tensor wire(const at::Tensor& flat) const override;
  BucketLaunch launch(const at::Tensor& wire, int64_t flat_begin, dist::Communicator& comm) override {
    return inner_->launch(wire, flat_begin, comm);
  }
  bool consecutive_buckets() const override { return inner_->consecutive_buckets(); }
  std::vector<size_t> bucket_starts() const override { return inner_->bucket_starts(); }
  int64_t storage_numel(int64_t numel) const override { return inner_->storage_numel(numel); }
  bool keeps_gradients() const override { return inner_->keeps_gradients(); }

 private:
  std::unique_ptr<BucketComm> inner_;
  at::ScalarType dtype_;
};

}  // namespace dtrain::engine

#include "dtrain/dist/glog_compat.h"  // last: keeps glog's LOG macros whatever the include order
