#include "mpi_runtime.h"

#include <algorithm>
#include <cstdlib>
#include <exception>
#include <functional>

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <glog/logging.h>

#include "mpi_health.h"

namespace dtrain::dist {
namespace {

// How long a failing rank waits for the others to shut down with it (see ~MpiRuntime).
constexpr int64_t kFailingShutdownMs = 5000;

std::mutex runtime_mutex;
std::weak_ptr<MpiRuntime> current_runtime;  // guarded by runtime_mutex
bool runtime_finalized = false;              // guarded by runtime_mutex

struct Sum { float operator()(float a, float b) const { return a + b; } };
struct Max { float operator()(float a, float b) const { return a > b ? a : b; } };
struct Min { float operator()(float a, float b) const { return a < b ? a : b; } };

// Reduction of 16-bit floats: computed in float, rounded back, as NCCL does per step.
template <typename T, typename F>
void reduce16(void* in, void* inout, int* len, MPI_Datatype*) {
  const T* a = static_cast<const T*>(in);
  T* b = static_cast<T*>(inout);
  F f;
  for (int i = 0; i < *len; ++i) b[i] = T(f(static_cast<float>(a[i]), static_cast<float>(b[i])));
}

}  // namespace

std::string mpi_error_string(int code) {
  char buf[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (MPI_Error_string(code, buf, &len) != MPI_SUCCESS) return "MPI error " + std::to_string(code);
  return std::string(buf, len);
}

std::string mpi_version() {
  int major = 0, minor = 0;
  MPI_Get_version(&major, &minor);
  char lib[MPI_MAX_LIBRARY_VERSION_STRING];
  int len = 0;
  MPI_Get_library_version(lib, &len);
  std::string l(lib, len);
  auto comma = l.find(',');
  if (comma != std::string::npos) l = l.substr(0, comma);
  return l + ", MPI " + std::to_string(major) + "." + std::to_string(minor);
}

std::shared_ptr<MpiRuntime> MpiRuntime::acquire() {
  std::lock_guard<std::mutex> lock(runtime_mutex);
  if (auto rt = current_runtime.lock()) return rt;
  DTRAIN_CHECK(!runtime_finalized,
               "MPI was already finalized in this process (all MPI communicators were "
               "destroyed) and cannot be started again; keep one communicator alive for the "
               "whole program");
  std::shared_ptr<MpiRuntime> rt(new MpiRuntime());
  current_runtime = rt;
  return rt;
}

void MpiRuntime::note_timeout(std::chrono::milliseconds timeout) {
  int64_t ms = timeout.count(), seen = shortest_timeout_ms_.load();
  while (ms < seen && !shortest_timeout_ms_.compare_exchange_weak(seen, ms)) {
  }
}

std::shared_ptr<MpiRuntime> MpiRuntime::current() {
  std::lock_guard<std::mutex> lock(runtime_mutex);
  return current_runtime.lock();
}

MpiRuntime::MpiRuntime() {
  int initialized = 0;
  MPI_Initialized(&initialized);
  int provided = MPI_THREAD_SINGLE;
  if (!initialized) {
    int rc = MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided);
    if (rc != MPI_SUCCESS) {
      DTRAIN_LIBRARY_FAILURE("MPI", "MPI_Init_thread failed: ", mpi_error_string(rc));
    }
    owns_init_ = true;
  } else {
    MPI_Query_thread(&provided);
  }
  version_ = mpi_version();
  const char* force = std::getenv("DTRAIN_MPI_SERIALIZE");  // tests: act as if MULTIPLE were missing
  if (force && std::string(force) == "1") {
    serialize_ = true;
    LOG(WARNING) << "DTRAIN_MPI_SERIALIZE=1: dtrain serializes its MPI calls with a process-wide "
                    "lock, as with an MPI that lacks MPI_THREAD_MULTIPLE";
  } else if (provided < MPI_THREAD_MULTIPLE) {
    serialize_ = true;
    LOG(WARNING) << "MPI (" << version_ << ") does not provide MPI_THREAD_MULTIPLE (got level "
                 << provided << "); dtrain serializes its MPI calls with a process-wide lock";
  }
  int world_size = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &world_size);
  const char* stall_check = std::getenv("DTRAIN_STALL_CHECK");
  if (stall_check && std::string(stall_check) == "0") {
    health_unavailable_ = "DTRAIN_STALL_CHECK=0";
  } else if (serialize_) {
    health_unavailable_ = "MPI calls are serialized (no MPI_THREAD_MULTIPLE)";
  } else if (world_size > 1) {
    health_ = HealthService::start();  // collective over MPI_COMM_WORLD
  }
  MPI_Op_create(&reduce16<c10::Half, Sum>, 1, &half_ops_[0]);
  MPI_Op_create(&reduce16<c10::Half, Max>, 1, &half_ops_[1]);
  MPI_Op_create(&reduce16<c10::Half, Min>, 1, &half_ops_[2]);
  MPI_Op_create(&reduce16<c10::BFloat16, Sum>, 1, &bf16_ops_[0]);
  MPI_Op_create(&reduce16<c10::BFloat16, Max>, 1, &bf16_ops_[1]);
  MPI_Op_create(&reduce16<c10::BFloat16, Min>, 1, &bf16_ops_[2]);
}

MpiRuntime::~MpiRuntime() {
  // Destroyed while an exception unwinds (the program is failing): maybe on this rank alone,
  // while the others wait in a collective. Then the collective shutdown gets a deadline, and
  // if the others do not join it this rank leaves without MPI_Finalize (which would wait for
  // them too), so its error is printed and the launcher ends the job at once.
  const bool failing = std::uncaught_exceptions() > 0;
  bool peers_finishing = true;
  if (health_) {
    const int64_t failing_ms = std::min<int64_t>(kFailingShutdownMs, shortest_timeout_ms_.load() / 2);
    peers_finishing = health_->shutdown(failing ? std::chrono::milliseconds(failing_ms)
                                                : std::chrono::milliseconds::max());
    health_.reset();
  }
  if (!peers_finishing) {
    LOG(ERROR) << "leaving without MPI_Finalize: this rank is failing and the other ranks are "
                  "not finishing with it; the launcher ends the job";
    std::lock_guard<std::mutex> lock(runtime_mutex);
    runtime_finalized = owns_init_;
    return;
  }
  for (MPI_Op* op : {&half_ops_[0], &half_ops_[1], &half_ops_[2], &bf16_ops_[0], &bf16_ops_[1],
                     &bf16_ops_[2]}) {
    if (*op != MPI_OP_NULL) MPI_Op_free(op);
  }
  if (owns_init_) {
    int rc = MPI_Finalize();
    if (rc != MPI_SUCCESS) LOG(ERROR) << "MPI_Finalize failed: " << mpi_error_string(rc);
  }
  std::lock_guard<std::mutex> lock(runtime_mutex);
  runtime_finalized = owns_init_;
}

std::unique_lock<std::mutex> MpiRuntime::lock() {
  if (!serialize_) return std::unique_lock<std::mutex>();
  return std::unique_lock<std::mutex>(mutex_);
}

MPI_Datatype MpiRuntime::datatype(c10::ScalarType type) const {
  switch (type) {
    case c10::kFloat: return MPI_FLOAT;
    case c10::kDouble: return MPI_DOUBLE;
    case c10::kLong: return MPI_INT64_T;
    case c10::kInt: return MPI_INT32_T;
    case c10::kByte: return MPI_UINT8_T;
    case c10::kChar: return MPI_INT8_T;
    case c10::kBool: return MPI_C_BOOL;
    case c10::kHalf:
    case c10::kBFloat16: return MPI_UINT16_T;  // reduced by our own operators
    default: break;
  }
  throw Error(std::string("no MPI datatype for ") + c10::toString(type));
}

MPI_Op MpiRuntime::reduce_op(ReduceOp op, c10::ScalarType type) const {
  // kAvg reduces with sum; the caller divides by the communicator size.
  int index = op == ReduceOp::kMax ? 1 : op == ReduceOp::kMin ? 2 : 0;
  if (type == c10::kHalf) return half_ops_[index];
  if (type == c10::kBFloat16) return bf16_ops_[index];
  if (type == c10::kBool) return index == 1 ? MPI_LOR : MPI_LAND;
  return index == 1 ? MPI_MAX : index == 2 ? MPI_MIN : MPI_SUM;
}

}  // namespace dtrain::dist
