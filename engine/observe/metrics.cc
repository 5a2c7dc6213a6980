#include "dtrain/engine/observe/metrics.h"

#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>

#include <glog/logging.h>
#include <nlohmann/json.hpp>

#include "dtrain/dist/error.h"

namespace dtrain::engine {

std::string to_json(const StepMetrics& m) {
  nlohmann::json j = {{"step", m.step},
                      {"loss", m.loss},
                      {"lr", m.lr},
                      {"step_ms", m.step_ms},
                      {"samples_per_s", m.samples_per_s},
                      {"mem_allocated_mb", m.mem_allocated_mb},
                      {"mem_peak_mb", m.mem_peak_mb}};
  if (!m.mem_counter.empty()) j["mem_counter"] = m.mem_counter;
  if (m.tokens_per_s) j["tokens_per_s"] = *m.tokens_per_s;
  if (m.loss_scale) j["loss_scale"] = *m.loss_scale;
  if (m.grad_norm) j["grad_norm"] = *m.grad_norm;
  if (m.eval_loss) j["eval_loss"] = *m.eval_loss;
  if (m.accum_steps) j["accum_steps"] = *m.accum_steps;
  for (auto& [k, v] : m.extra) j[k] = v;
  return j.dump();
}

MetricsWriter::MetricsWriter(const std::string& path, bool enabled) {
  if (!enabled || path.empty()) return;
  path_ = path;
  file_ = std::fopen(path.c_str(), "w");
  DTRAIN_CHECK(file_ != nullptr, "cannot write the metrics file '", path, "': ",
               std::strerror(errno), "; pass a writable path to --metrics");
}

std::unique_ptr<MetricsWriter> MetricsWriter::open_append(const std::string& path, bool enabled) {
  std::unique_ptr<MetricsWriter> w(new MetricsWriter());
  if (!enabled || path.empty()) return w;
  w->path_ = path;
  w->file_ = std::fopen(path.c_str(), "a");
  DTRAIN_CHECK(w->file_ != nullptr, "cannot append to the metrics file '", path, "': ",
               std::strerror(errno), "; pass a writable path to --metrics");
  return w;
}

void MetricsWriter::keep_through_step(int64_t step) {
  if (!file_) return;
  if (std::fclose(file_) != 0) LOG(ERROR) << "closing the metrics file failed";
  file_ = nullptr;
  std::string kept;
  int dropped = 0;
  if (std::FILE* in = std::fopen(path_.c_str(), "r")) {
    std::string line;
    for (int c = std::fgetc(in);; c = std::fgetc(in)) {
      if (c != EOF && c != '\n') {
        line += static_cast<char>(c);
        continue;
      }
      if (!line.empty()) {
        const nlohmann::json j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
        if (j.is_object() && j.contains("step") && j["step"].is_number_integer() && j["step"].get<int64_t>() > step) {
          ++dropped;
        } else {
          kept += line + '\n';
        }
      }
      line.clear();
      if (c == EOF) break;
    }
    std::fclose(in);
  }
  if (dropped > 0) {
    const std::string tmp = path_ + ".tmp";
    std::FILE* out = std::fopen(tmp.c_str(), "w");
    DTRAIN_CHECK(out != nullptr, "cannot rewrite the metrics file '", path_, "' (", tmp, "): ", std::strerror(errno));
    const bool written = std::fwrite(kept.data(), 1, kept.size(), out) == kept.size() && std::fflush(out) == 0 &&
                         fsync(fileno(out)) == 0;
    const bool closed = std::fclose(out) == 0;
    if (!written || !closed || std::rename(tmp.c_str(), path_.c_str()) != 0) {
      const std::string why = std::strerror(errno);
      std::remove(tmp.c_str());
      throw Error("rewriting the metrics file '" + path_ + "' failed: " + why);
    }
    LOG(INFO) << "metrics file " << path_ << ": dropped " << dropped << " line(s) of steps after " << step
              << ", which this run logs again from its checkpoint";
  }
  file_ = std::fopen(path_.c_str(), "a");
  DTRAIN_CHECK(file_ != nullptr, "cannot append to the metrics file '", path_, "': ", std::strerror(errno));
}

MetricsWriter::~MetricsWriter() {
  if (file_ && std::fclose(file_) != 0) LOG(ERROR) << "closing the metrics file failed";
}

void MetricsWriter::write(const StepMetrics& m) {
  if (!file_) return;
  std::string line = to_json(m);
  line += '\n';
  if (std::fwrite(line.data(), 1, line.size(), file_) != line.size() || std::fflush(file_) != 0) {
    throw Error(std::string("writing the metrics file failed: ") + std::strerror(errno));
  }
}

namespace {
// A terminal the user looks at. Open MPI gives ranks a pseudo-terminal even when mpirun's own
// output goes to a file, so under mpirun we print plain lines.
bool interactive_terminal() {
  return isatty(STDOUT_FILENO) == 1 && std::getenv("OMPI_COMM_WORLD_SIZE") == nullptr;
}
}  // namespace

Progress::Progress(int64_t total_steps, bool enabled)
    : total_(total_steps), enabled_(enabled), tty_(interactive_terminal()) {}

void Progress::update(const StepMetrics& m) {
  if (!enabled_) return;
  char extra[160] = "";
  if (m.loss_scale) std::snprintf(extra, sizeof(extra), " scale %.0f", *m.loss_scale);
  if (m.eval_loss) {
    size_t n = std::strlen(extra);
    std::snprintf(extra + n, sizeof(extra) - n, " eval %.4f", *m.eval_loss);
  }
  if (tty_) {
    const int width = 30;
    int filled = total_ > 0 ? static_cast<int>(width * m.step / total_) : 0;
    std::string bar(filled, '#');
    bar.resize(width, '.');
    std::printf("\r[%s] %lld/%lld loss %.4f %.1f ms/step %.0f samples/s%s   ", bar.c_str(),
                static_cast<long long>(m.step), static_cast<long long>(total_), m.loss, m.step_ms,
                m.samples_per_s, extra);
  } else {
    std::printf("step %lld/%lld loss %.6f lr %.3g %.1f ms/step %.0f samples/s mem %.0f MB%s\n",
                static_cast<long long>(m.step), static_cast<long long>(total_), m.loss, m.lr,
                m.step_ms, m.samples_per_s, m.mem_allocated_mb, extra);
  }
  std::fflush(stdout);
}

void Progress::finish() {
  if (enabled_ && tty_) std::printf("\n");
}

}  // namespace dtrain::engine
