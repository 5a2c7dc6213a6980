#include "dtrain/engine/observe/tensorboard.h"

#include <glog/logging.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstring>
#include <string_view>

#include "dtrain/dist/error.h"
#include "obs_files.h"
#include "tensorboard/event_proto.h"

namespace dtrain::engine {
namespace {

constexpr char kFileVersion[] = "brain.Event:2";

double now_seconds() {
  using namespace std::chrono;
  return duration<double>(system_clock::now().time_since_epoch()).count();
}

std::string host_name() {
  char buf[256] = {};
  if (gethostname(buf, sizeof buf - 1) != 0) return "localhost";
  return buf;
}

// events.out.tfevents.<seconds>.<host>.<pid>.<n>: TensorBoard picks up any file whose name
// holds "tfevents"; n keeps two writers of one process in one second apart.
std::string events_file_name() {
  static std::atomic<int> counter{0};
  const auto seconds = static_cast<int64_t>(now_seconds());
  return "events.out.tfevents." + std::to_string(seconds) + "." + host_name() + "." +
         std::to_string(getpid()) + "." + std::to_string(counter.fetch_add(1));
}

void create_directory(const std::string& dir) {
  const std::string why = obs_detail::make_directories(dir);
  DTRAIN_CHECK(why.empty(), "cannot create the TensorBoard directory '", dir, "': ", why,
               " (pass a writable --tensorboard_dir)");
}

constexpr uint32_t kMaskDelta = 0xa282ead8u;

void put_le32(char* out, uint32_t v) {
  for (int i = 0; i < 4; ++i) out[i] = static_cast<char>((v >> (8 * i)) & 0xFFu);
}

}  // namespace

EventWriter::EventWriter(const std::string& dir, bool enabled) {
  if (!enabled) return;
  DTRAIN_CHECK(!dir.empty(), "the TensorBoard directory is empty (pass --tensorboard_dir=DIR)");
  create_directory(dir);
  path_ = obs_detail::join_path(dir, events_file_name());
  file_ = std::fopen(path_.c_str(), "wb");
  DTRAIN_CHECK(file_ != nullptr, "cannot write into the TensorBoard directory '", dir,
               "': ", std::strerror(errno), " (pass a writable --tensorboard_dir)");
  try {
    write_record(tb_detail::file_version_event(now_seconds(), kFileVersion));
    flush();
  } catch (const Error&) {
    std::fclose(file_);
    file_ = nullptr;
    throw;
  }
}

EventWriter::~EventWriter() {
  if (!file_) return;
  if (std::fflush(file_) != 0 || std::ferror(file_)) {
    LOG(ERROR) << "flushing the TensorBoard file " << path_ << " failed";
  }
  if (std::fclose(file_) != 0) LOG(ERROR) << "closing the TensorBoard file " << path_ << " failed";
}

void EventWriter::write_record(const std::string& data) {
  const std::string record = tfrecord_frame(data);
  if (std::fwrite(record.data(), 1, record.size(), file_) != record.size()) {
    throw Error("writing the TensorBoard file '" + path_ + "' failed: " + std::strerror(errno));
  }
}

void EventWriter::add_scalar(const std::string& tag, int64_t step, double value,
                             std::optional<double> wall_time) {
  if (!file_) return;
  write_record(tb_detail::scalar_event(wall_time.value_or(now_seconds()), step, tag,
                                       static_cast<float>(value)));
}

void EventWriter::add_text(const std::string& tag, int64_t step, const std::string& text,
                           std::optional<double> wall_time) {
  if (!file_) return;
  write_record(tb_detail::text_event(wall_time.value_or(now_seconds()), step, tag, text));
}

void EventWriter::add_metrics(const StepMetrics& m, std::optional<double> wall_time) {
  if (!file_) return;
  const double t = wall_time.value_or(now_seconds());
  const int64_t s = m.step;
  add_scalar("train/loss", s, m.loss, t);
  add_scalar("train/lr", s, m.lr, t);
  if (m.loss_scale) add_scalar("train/loss_scale", s, *m.loss_scale, t);
  if (m.grad_norm) add_scalar("train/grad_norm", s, *m.grad_norm, t);
  if (m.eval_loss) add_scalar("eval/loss", s, *m.eval_loss, t);
  add_scalar("perf/step_ms", s, m.step_ms, t);
  add_scalar("perf/samples_per_s", s, m.samples_per_s, t);
  if (m.tokens_per_s) add_scalar("perf/tokens_per_s", s, *m.tokens_per_s, t);
  add_scalar("memory/allocated_mb", s, m.mem_allocated_mb, t);
  add_scalar("memory/peak_mb", s, m.mem_peak_mb, t);
  for (const auto& [key, value] : m.extra) add_scalar("extra/" + key, s, value, t);
  flush();
}

void EventWriter::add_resume(int64_t step) {
  if (!file_) return;
  write_record(tb_detail::session_start_event(now_seconds(), step, "resumed at step " + std::to_string(step)));
  flush();
}

void EventWriter::flush() {
  if (!file_) return;
  if (std::fflush(file_) != 0) {
    throw Error("flushing the TensorBoard file '" + path_ + "' failed: " + std::strerror(errno));
  }
}

uint32_t mask_crc32c(uint32_t crc) { return ((crc >> 15) | (crc << 17)) + kMaskDelta; }

std::string tfrecord_frame(std::string_view data) {
  std::string out(8 + 4 + data.size() + 4, '\0');
  const uint64_t length = data.size();
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((length >> (8 * i)) & 0xFFu);
  put_le32(&out[8], mask_crc32c(crc32c(out.data(), 8)));
  if (!data.empty()) std::memcpy(&out[12], data.data(), data.size());
  put_le32(&out[12 + data.size()], mask_crc32c(crc32c(data.data(), data.size())));
  return out;
}

}  // namespace dtrain::engine
