#include "dtrain/engine/observe/profiler.h"

#include <cstdio>
#include <cstdlib>
#include <optional>
#include <set>
#include <sstream>

#include <ATen/ATen.h>
#include <ATen/record_function.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <glog/logging.h>
#include <torch/csrc/autograd/profiler_kineto.h>

#include "dtrain/dist/error.h"
#include "obs_files.h"

namespace dtrain::engine {

namespace prof = torch::profiler::impl;

ProfileSteps parse_profile_steps(const std::string& text) { return parse_step_range(text, "--profile_steps"); }

ProfileSteps parse_step_range(const std::string& text, const std::string& flag) {
  ProfileSteps steps;
  if (text.empty()) return steps;
  std::istringstream in(text);
  char dash = 0;
  bool ok = static_cast<bool>(in >> steps.first);
  if (ok && in.peek() == '-') {
    ok = static_cast<bool>(in >> dash >> steps.last);
  } else {
    steps.last = steps.first;
  }
  ok = ok && in.peek() == std::char_traits<char>::eof() && steps.first >= 1 && steps.last >= steps.first;
  DTRAIN_CHECK(ok, flag, "='", text, "' is not a step or a range of steps: give N or A-B with 1 <= A <= B (e.g. ",
               flag, "=5-7)");
  return steps;
}

// The user range of one step, shown above its operators in the trace.
struct StepProfiler::StepRange {
  explicit StepRange(int64_t step) : name("dtrain step " + std::to_string(step)), guard(at::RecordScope::USER_SCOPE) {
    if (guard.isActive()) guard.before(std::string_view(name));
  }
  std::string name;
  at::RecordFunction guard;
};

StepProfiler::StepProfiler(ProfileSteps steps, std::string path, c10::Device device)
    : steps_(steps), path_(std::move(path)), device_(device) {
  if (!steps_.enabled()) return;
  // On a CPU run Kineto's device probe logs a CUDA error that means nothing here; its own log
  // level hides it unless the user set one.
  if (device_.is_cpu()) setenv("KINETO_LOG_LEVEL", "4", /*overwrite=*/0);
  DTRAIN_CHECK(!path_.empty(), "profiling steps ", steps_.first, "-", steps_.last,
               " needs a file to write the trace to (--profile_out=PATH)");
  const std::string dir = obs_detail::parent_dir(path_);
  if (!dir.empty()) {
    const std::string why = obs_detail::make_directories(dir);
    DTRAIN_CHECK(why.empty(), "cannot create the directory '", dir, "' of --profile_out='", path_, "': ", why);
  }
}

StepProfiler::~StepProfiler() {
  if (!active_) return;
  try {
    stop_and_write();
  } catch (const std::exception& e) {
    LOG(ERROR) << "the profile of steps " << steps_.first << "-" << steps_.last << " was not written: " << e.what();
  }
}

void StepProfiler::begin_step(int64_t step) {
  if (!steps_.enabled() || step < steps_.first || step > steps_.last) return;
  if (!active_) {
    std::set<prof::ActivityType> activities{prof::ActivityType::CPU};
    if (device_.is_cuda()) activities.insert(prof::ActivityType::CUDA);
    const prof::ProfilerConfig config(prof::ProfilerState::KINETO, /*report_input_shapes=*/true);
    torch::autograd::profiler::prepareProfiler(config, activities);
    torch::autograd::profiler::enableProfiler(config, activities);
    active_ = true;
  }
  range_ = std::make_unique<StepRange>(step);
}

void StepProfiler::end_step(int64_t step) {
  if (!active_) return;
  range_.reset();
  if (step >= steps_.last) stop_and_write();
}

void StepProfiler::stop_and_write() {
  range_.reset();
  if (!device_.is_cpu()) {
    c10::impl::VirtualGuardImpl impl(device_.type());
    impl.synchronizeDevice(device_.index());  // the kernels of the last step are in the trace
  }
  std::unique_ptr<torch::autograd::profiler::ProfilerResult> result = torch::autograd::profiler::disableProfiler();
  active_ = false;
  const std::string tmp = path_ + ".tmp";
  result->save(tmp);
  DTRAIN_CHECK(std::rename(tmp.c_str(), path_.c_str()) == 0, "cannot move the profile '", tmp, "' to '", path_, "'");
  LOG(INFO) << "profile of steps " << steps_.first << "-" << steps_.last << " written to " << path_
            << " (open it in https://ui.perfetto.dev or chrome://tracing)";
}

}  // namespace dtrain::engine
