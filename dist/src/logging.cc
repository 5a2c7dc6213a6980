#include "dtrain/dist/logging.h"

#include <atomic>
#include <iomanip>

#include <glog/logging.h>

#include "dtrain/dist/error.h"

namespace dtrain::dist {
namespace {

std::atomic<int> prefix_rank{0};
std::atomic<int> prefix_size{1};

void rank_prefix(std::ostream& s, const google::LogMessageInfo& l, void*) {
  s << "[r" << prefix_rank.load() << "] " << l.severity[0] << std::setw(2) << std::setfill('0')
    << 1 + l.time.month() << std::setw(2) << l.time.day() << ' ' << std::setw(2)
    << l.time.hour() << ':' << std::setw(2) << l.time.min() << ':' << std::setw(2)
    << l.time.sec() << '.' << std::setw(3) << l.time.usec() / 1000 << std::setfill(' ') << ' '
    << l.filename << ':' << l.line_number << ']';
}

}  // namespace

void init_logging(const char* argv0, const World& world) {
  prefix_rank = world.rank;
  prefix_size = world.size;
  set_process_identity(world.rank, world.size, world.host);
  static std::once_flag once;
  std::call_once(once, [&] {
    FLAGS_logtostderr = true;
    if (!google::IsGoogleLoggingInitialized()) {
      google::InitGoogleLogging(argv0 ? argv0 : "dtrain", &rank_prefix, nullptr);
    }
  });
}

}  // namespace dtrain::dist
