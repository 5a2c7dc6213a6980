// dtrain-bench allreduce: nccl-tests style figures for the Communicator, next to the
// backend's own raw call on the same buffer in the same run.
#include <gflags/gflags.h>

#include <algorithm>
#include <chrono>
#include <cstdio>

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include "bench.h"
#include "dtrain/dist/communicator.h"
#include "dtrain/dist/error.h"

DEFINE_int64(min_bytes, 1024, "allreduce: smallest message in bytes");
DEFINE_int64(max_bytes, int64_t{256} << 20, "allreduce: largest message in bytes");
DEFINE_int32(iters, 0, "timed iterations per size (0: scale with size, 5..200)");
DEFINE_int32(warmup, 3, "warm-up iterations per size");
DEFINE_string(dtype, "float32", "allreduce: float32, float64, bfloat16, float16, int64");

namespace dtrain::bench {
namespace {

at::ScalarType parse_dtype(const std::string& s) {
  if (s == "float32") return at::kFloat;
  if (s == "float64") return at::kDouble;
  if (s == "bfloat16") return at::kBFloat16;
  if (s == "float16") return at::kHalf;
  if (s == "int64") return at::kLong;
  throw Error("unknown --dtype=" + s + "; use float32, float64, bfloat16, float16 or int64");
}

// Max over ranks: the slowest rank's median is the collective's time.
double max_over_ranks(dist::Communicator& comm, double x) {
  at::Tensor t = at::full({1}, x, at::kDouble);
  comm.all_reduce(t, dist::ReduceOp::kMax)->wait();
  return t.item<double>();
}

void sync_device(const at::Tensor& t) {
  if (t.is_cuda()) t.cpu();  // cheap host sync of the current stream's work on this tensor
}

}  // namespace

int run_allreduce(BenchContext& ctx) {
  dist::Communicator& comm = *ctx.comm;
  const int n = comm.size();
  at::ScalarType dtype = parse_dtype(FLAGS_dtype);
  const int64_t esize = c10::elementSize(dtype);
  DTRAIN_CHECK(FLAGS_min_bytes >= esize && FLAGS_max_bytes >= FLAGS_min_bytes,
               "--min_bytes must be at least one element and not above --max_bytes");
  const bool raw_comparable = ctx.device.is_cpu() || std::string(comm.backend()) == "nccl";
  for (int64_t bytes = FLAGS_min_bytes; bytes <= FLAGS_max_bytes; bytes *= 2) {
    const int64_t count = bytes / esize;
    int iters = FLAGS_iters > 0 ? FLAGS_iters
                                : static_cast<int>(std::clamp<int64_t>((int64_t{1} << 30) / bytes, 5, 200));
    at::Tensor buf = at::ones({count}, at::TensorOptions().dtype(dtype).device(ctx.device));
    at::Tensor out = at::empty_like(buf);
    at::Tensor raw_buf = raw_comparable ? buf : buf.cpu();
    at::Tensor raw_out = at::empty_like(raw_buf);
    for (bool in_place : {true, false}) {
      std::vector<double> ours, raw;
      for (int i = 0; i < FLAGS_warmup; ++i) {
        (in_place ? comm.all_reduce(buf) : comm.all_reduce(buf, out, dist::ReduceOp::kSum))->synchronize();
        comm.raw_all_reduce_blocking(raw_buf, in_place ? raw_buf : raw_out);
      }
      comm.barrier()->wait();
      for (int i = 0; i < iters; ++i) {
        // Interleaved, so both see the same machine conditions.
        auto t0 = std::chrono::steady_clock::now();
        (in_place ? comm.all_reduce(buf) : comm.all_reduce(buf, out, dist::ReduceOp::kSum))->synchronize();
        auto t1 = std::chrono::steady_clock::now();
        comm.raw_all_reduce_blocking(raw_buf, in_place ? raw_buf : raw_out);
        sync_device(raw_buf);
        auto t2 = std::chrono::steady_clock::now();
        ours.push_back(std::chrono::duration<double, std::milli>(t1 - t0).count());
        raw.push_back(std::chrono::duration<double, std::milli>(t2 - t1).count());
      }
      double ms = max_over_ranks(comm, median(ours));
      double raw_ms = max_over_ranks(comm, median(raw));
      // Data check after timing: every rank contributes rank+1.
      at::Tensor check = at::full({count}, comm.rank() + 1, buf.options());
      at::Tensor check_out = in_place ? check : at::empty_like(check);
      (in_place ? comm.all_reduce(check) : comm.all_reduce(check, check_out, dist::ReduceOp::kSum))->wait();
      double want = n * (n + 1) / 2.0;
      bool ok = count == 0 || (check_out.cpu().to(at::kDouble) == want).all().item<bool>();
      // nccl-tests: algbw = bytes / time; busbw = algbw * 2(n-1)/n for all-reduce.
      auto gbs = [&](double t) { return t > 0 ? bytes / (t * 1e-3) / 1e9 : 0.0; };
      double factor = 2.0 * (n - 1) / n;
      nlohmann::json j = {{"bench", "allreduce"}, {"backend", comm.backend()},
                          {"device", ctx.device.str()}, {"world", n}, {"dtype", FLAGS_dtype},
                          {"inplace", in_place}, {"bytes", bytes}, {"count", count},
                          {"iters", iters}, {"ms", ms}, {"algbw_gbs", gbs(ms)},
                          {"busbw_gbs", gbs(ms) * factor}, {"raw_ms", raw_ms},
                          {"raw_busbw_gbs", gbs(raw_ms) * factor},
                          {"busbw_over_raw", ms > 0 ? raw_ms / ms : 0.0},
                          {"check", ok ? "ok" : "WRONG"}};
      if (comm.rank() == 0) std::printf("%s\n", j.dump().c_str());
      std::fflush(stdout);
      if (!ok) return 1;
    }
    if (bytes > FLAGS_max_bytes / 2) break;
  }
  return 0;
}

}  // namespace dtrain::bench
