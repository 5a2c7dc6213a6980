// The stall check between ranks: when a collective waits half its timeout, each waiting rank
// asks the others whether they have reached it, and its stall warning names those that have
// not (world ranks, with their hosts). Here the last rank of a communicator enters an
// all-reduce late (within the timeout), so the warning fires on the others, names exactly that
// rank, and the operation then completes normally; later collectives are unaffected.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <regex>
#include <thread>

#include "../../dist/src/async.h"
#include "../../dist/src/health.h"
#include "dtrain/dist/communicator.h"
#include "test_util.h"
#include "watchdog_messages.h"

namespace dtrain::dist {
namespace {

using namespace std::chrono_literals;
using testing_util::world_comm;
using testing_watchdog::WatchdogMessages;

constexpr auto kTimeout = 4000ms;  // stall check at 2 s, arrival window 1 s

// Every rank's host name, by world rank.
std::vector<std::string> hosts() {
  constexpr int64_t kLen = 64;
  at::Tensor mine = at::zeros({kLen}, at::kByte);
  gethostname(reinterpret_cast<char*>(mine.data_ptr<uint8_t>()), kLen - 1);
  at::Tensor all = at::zeros({kLen * world_comm().size()}, at::kByte);
  world_comm().all_gather(mine, all)->wait();
  std::vector<std::string> out;
  for (int r = 0; r < world_comm().size(); ++r) {
    const char* h = reinterpret_cast<const char*>(all.data_ptr<uint8_t>() + r * kLen);
    out.emplace_back(h, strnlen(h, kLen));
  }
  return out;
}

std::string escape(const std::string& s) {
  return std::regex_replace(s, std::regex(R"([.^$|()\[\]{}*+?\\])"), R"(\$&)");
}

std::unique_ptr<Communicator> comm_with_timeout(const std::string& name) {
  CommOptions options;
  options.timeout = kTimeout;
  options.name = name;
  return create_communicator("mpi", testing_util::world(), c10::Device(c10::kCPU), options);
}

// Runs all-reduce #2 (after barrier #1) on `comm`, the member with world rank `late` entering
// it `delay` late (after `before_delay` on that rank), and checks the sum of world ranks.
void late_all_reduce(Communicator& comm, const std::vector<int>& members, int late,
                     std::chrono::milliseconds delay,
                     const std::function<void()>& before_delay = {}) {
  comm.barrier()->wait();
  if (testing_util::world().rank == late) {
    if (before_delay) before_delay();
    std::this_thread::sleep_for(delay);
  }
  at::Tensor x = at::full({3}, static_cast<double>(testing_util::world().rank), at::kDouble);
  comm.all_reduce(x)->wait();
  double expected = 0;
  for (int r : members) expected += r;
  EXPECT_EQ(x[0].item<double>(), expected);
  EXPECT_EQ(x[2].item<double>(), expected);
}

// The expected stall warning on world rank `me` for all-reduce #2 on `name` (members: world
// ranks by local rank), when `late` has not arrived; `late_detail` says where it is.
std::regex expected_warning(const std::string& name, const std::vector<int>& members, int me,
                            int late, const std::string& late_detail) {
  auto host = hosts();
  int local = static_cast<int>(std::find(members.begin(), members.end(), me) - members.begin());
  std::string re = "collective stall: all_reduce #2 on '" + escape(name) + "' \\(mpi, rank " +
                   std::to_string(local) + "/" + std::to_string(members.size()) +
                   ", Double\\[3\\], sum\\) has been waiting [0-9.]+ s \\(timeout 4 s\\); rank " +
                   std::to_string(late) + " \\(host " + escape(host[late]) +
                   "\\) has not reached it \\(rank " + std::to_string(late) + ": " + late_detail +
                   "\\)";
  std::vector<int> others;
  for (int r : members) {
    if (r != me && r != late) others.push_back(r);
  }
  std::sort(others.begin(), others.end());
  if (!others.empty()) {
    re += others.size() == 1 ? "; rank " : "; ranks ";
    for (size_t i = 0; i < others.size(); ++i) {
      re += (i ? "," : "") + std::to_string(others[i]);
      // Hosts are grouped while consecutive ranks share one.
      if (i + 1 == others.size() || host[others[i + 1]] != host[others[i]]) {
        re += " \\(host " + escape(host[others[i]]) + "\\)" + (i + 1 < others.size() ? ", " : "");
      }
    }
    re += others.size() == 1 ? " is waiting in it too" : " are waiting in it too";
  }
  return std::regex(re);
}

// Later collectives on the world and on `comm` still give closed-form results.
// The late rank itself logged no stall warning; every other rank exactly one, matching want.
void expect_warnings(const std::vector<std::string>& warnings, bool late, const std::regex& want) {
  if (late) {
    EXPECT_TRUE(warnings.empty()) << warnings[0];
    return;
  }
  ASSERT_EQ(warnings.size(), 1u);
  EXPECT_TRUE(std::regex_match(warnings[0], want)) << warnings[0];
}

void check_collectives_still_work(Communicator& comm) {
  const int n = world_comm().size();
  at::Tensor y = at::full({5}, static_cast<float>(world_comm().rank()), at::kFloat);
  world_comm().all_reduce(y)->wait();
  EXPECT_EQ(y[4].item<float>(), n * (n - 1) / 2.0f);
  at::Tensor z = at::ones({7}, at::kLong);
  comm.all_reduce(z)->wait();
  EXPECT_EQ(z[0].item<int64_t>(), comm.size());
  comm.barrier()->wait();
}

// Member `late` of `comm` (world ranks `members`, by local rank) enters all-reduce #2 `delay`
// late, after `before_delay` on that rank: every other member logs one stall warning naming it
// (`late_detail`: where it is), the late rank none; `settle` later, collectives on the world and
// on `comm` still work. Returns the time from the barrier until the warnings were in.
std::chrono::steady_clock::duration expect_late_rank_named(Communicator& comm, const std::vector<int>& members,
                                                           int late, const std::string& late_detail,
                                                           std::chrono::milliseconds delay,
                                                           const std::function<void()>& before_delay = {},
                                                           std::chrono::milliseconds settle = 0ms) {
  const int me = world_comm().rank();
  std::regex want = expected_warning(comm.name(), members, me, late, late_detail);
  WatchdogMessages messages(/*fail_on_timeout=*/true);
  const auto start = std::chrono::steady_clock::now();
  late_all_reduce(comm, members, late, delay, before_delay);
  auto warnings = messages.wait_for(me == late ? 0 : 1, 2000ms);
  const auto elapsed = std::chrono::steady_clock::now() - start;
  expect_warnings(warnings, me == late, want);
  std::this_thread::sleep_for(settle);
  check_collectives_still_work(comm);
  return elapsed;
}

// The world's ranks in order: the members of a communicator of all of them.
std::vector<int> world_ranks() {
  std::vector<int> members(world_comm().size());
  for (int r = 0; r < world_comm().size(); ++r) members[r] = r;
  return members;
}

TEST(StallArrivals, LateRankIsNamedAndTheOperationCompletes) {
  auto comm = comm_with_timeout("stall");
  expect_late_rank_named(*comm, world_ranks(), world_comm().size() - 1, "done with #1, not in any collective",
                         3000ms);
}

TEST(StallArrivals, RankThatDoesNotAnswerIsReportedAfterTheWindow) {
  auto comm = comm_with_timeout("silent");
  // The late rank's health service is paused past the window, as if the process were stopped;
  // it enters after the stall check has given up on it (at about 2 s + 1 s). Its late replies
  // reach the others after they gave up: dropped, and nothing breaks (checked 500 ms later).
  const auto elapsed = expect_late_rank_named(
      *comm, world_ranks(), world_comm().size() - 1, "no reply - stopped, dead or unreachable", 3600ms,
      [] { ASSERT_TRUE(pause_health_service_for_testing(4000ms)); }, /*settle=*/500ms);
  EXPECT_LT(elapsed, 6000ms);
}

TEST(StallArrivals, SubgroupsNameWorldRanks) {
  const int n = world_comm().size();
  if (n < 4) GTEST_SKIP() << "needs 4 ranks for two groups of two or more";
  const int me = world_comm().rank();
  auto parent = comm_with_timeout("sub");
  // Groups by parity, ranked in reverse, so local rank 0 is the highest world rank and the
  // group's key comes from a member that is not local rank 0.
  auto group = parent->split(me % 2, -me, "parity" + std::to_string(me % 2));
  std::vector<int> members;
  for (int r = n - 1; r >= 0; --r) {
    if (r % 2 == me % 2) members.push_back(r);
  }
  ASSERT_EQ(group->rank(),
            static_cast<int>(std::find(members.begin(), members.end(), me) - members.begin()));
  const int late = members.front();  // the group's highest world rank
  expect_late_rank_named(*group, members, late, "done with #1, not in any collective", 3000ms);
}

}  // namespace
}  // namespace dtrain::dist
