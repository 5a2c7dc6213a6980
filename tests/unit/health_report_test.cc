// Stall reports in one process: the text naming the ranks that have not reached an operation,
// the window a stall check waits, and how the watchdog puts the report into its stall warning
// and timeout message. (The protocol between ranks is tested in tests/mpi/stall_arrivals_test.cc.)
#include <gtest/gtest.h>

#include <regex>
#include <thread>

#include "../../dist/src/async.h"
#include "../../dist/src/health.h"
#include "watchdog_messages.h"

namespace dtrain::dist {
namespace {

using State = PeerArrival::State;
using testing_watchdog::WatchdogMessages;

PeerArrival peer(int rank, const std::string& host, State state, uint64_t reached = 0,
                 uint64_t completed = 0, const std::string& doing = "") {
  PeerArrival p;
  p.world_rank = rank;
  p.host = host;
  p.state = state;
  p.reached = reached;
  p.completed = completed;
  p.doing = doing;
  return p;
}

TEST(HealthReport, NamesTheSilentRankAndTheRanksWaitingToo) {
  // Given out of rank order: the text lists ranks in increasing order.
  std::string text =
      format_arrivals({peer(2, "node1", State::kWaiting, 12, 11), peer(3, "node2", State::kNoReply),
                       peer(1, "node1", State::kWaiting, 12, 11)});
  EXPECT_EQ(text,
            "rank 3 (host node2) has not reached it (rank 3: no reply - stopped, dead or "
            "unreachable); ranks 1,2 (host node1) are waiting in it too");
}

TEST(HealthReport, GroupsRanksByHostAndSaysWhereEachMissingRankIs) {
  std::string text = format_arrivals(
      {peer(2, "a", State::kNotReached, 8, 7), peer(3, "a", State::kNotReached, 8, 8),
       peer(5, "b", State::kNotReached, 8, 8, "barrier #3 on 'world/tp1' (mpi) for 2.5 s"),
       peer(6, "b", State::kUnknownComm), peer(7, "", State::kNotReached, 0, 0)});
  EXPECT_EQ(text,
            "ranks 2,3 (host a), 5,6 (host b), 7 have not reached it (rank 2: still in #8 on this "
            "communicator; rank 3: done with #8, not in any collective; rank 5: done with #8, "
            "waiting in barrier #3 on 'world/tp1' (mpi) for 2.5 s; rank 6: has no such "
            "communicator (not created yet, or destroyed); rank 7: no operation yet, not in any "
            "collective)");
}

TEST(HealthReport, SaysWhenEveryRankHasArrivedOrSomeCompletedAlready) {
  EXPECT_EQ(format_arrivals({peer(1, "h", State::kWaiting, 4, 3)}),
            "every other rank has reached it; rank 1 (host h) is waiting in it too");
  EXPECT_EQ(
      format_arrivals({peer(1, "h", State::kCompleted, 5, 5), peer(2, "h", State::kWaiting, 4, 3)}),
      "every other rank has reached it; rank 2 (host h) is waiting in it too; rank 1 "
      "(host h) has already completed it");
  EXPECT_EQ(format_arrivals({}), "");
}

TEST(HealthReport, ArrivalWindowIsAQuarterOfTheTimeoutBetween100msAnd5s) {
  using std::chrono::milliseconds;
  EXPECT_EQ(arrival_window(milliseconds(60000)), milliseconds(5000));
  EXPECT_EQ(arrival_window(milliseconds(6000)), milliseconds(1500));
  EXPECT_EQ(arrival_window(milliseconds(200)), milliseconds(100));
}

TEST(HealthReport, CompletedOnlyMovesForward) {
  OpProgress p;
  p.complete(5);
  p.complete(3);
  EXPECT_EQ(p.completed.load(), 5u);
  p.complete(6);
  EXPECT_EQ(p.completed.load(), 6u);
}

TEST(HealthReport, StallWarningAndTimeoutNameWhoHasNotArrived) {
  WatchdogMessages messages;
  uint64_t token = Watchdog::instance().watch(
      {"all_reduce #12 on 'world/dp0' (fake)", std::chrono::milliseconds(600), [] { return false; },
       nullptr,
       [] { return std::string("rank 3 (host node2) has not reached it (rank 3: no reply)"); }});
  auto [warning, timeout] = messages.wait();
  Watchdog::instance().unwatch(token);
  EXPECT_TRUE(std::regex_match(
      warning, std::regex("collective stall: all_reduce #12 on 'world/dp0' \\(fake\\) has been "
                          "waiting 0\\.[3-5][0-9]* s \\(timeout 0\\.6 s\\); rank 3 \\(host "
                          "node2\\) has not reached it \\(rank 3: no reply\\)")))
      << warning;
  EXPECT_TRUE(std::regex_search(
      timeout, std::regex("^collective timeout: all_reduce #12 on 'world/dp0' \\(fake\\) did not "
                          "complete within 0\\.6 s \\([^)]*\\); at 0\\.[3-5][0-9]* s rank 3 "
                          "\\(host node2\\) has not reached it \\(rank 3: no reply\\); a peer")))
      << timeout;
}

TEST(HealthReport, TimeoutSaysWhenTheArrivalCheckHadNotFinished) {
  WatchdogMessages messages;
  uint64_t token =
      Watchdog::instance().watch({"barrier #2 on 'world' (fake)", std::chrono::milliseconds(400),
                                  [] { return false; }, nullptr,
                                  [] {
                                    std::this_thread::sleep_for(std::chrono::milliseconds(800));
                                    return std::string("rank 1 (host h) has not reached it");
                                  }});
  auto [warning, timeout] = messages.wait();  // the warning comes after the timeout here
  Watchdog::instance().unwatch(token);
  EXPECT_NE(timeout.find("did not complete within 0.4 s"), std::string::npos) << timeout;
  EXPECT_NE(timeout.find("; the check of which ranks had arrived did not finish; a peer"),
            std::string::npos)
      << timeout;
  EXPECT_NE(warning.find("collective stall: barrier #2 on 'world' (fake) has been waiting"),
            std::string::npos)
      << warning;
  EXPECT_NE(warning.find("; rank 1 (host h) has not reached it"), std::string::npos) << warning;
}

TEST(HealthReport, WithoutArrivalsTheWarningIsTheOldOne) {
  WatchdogMessages messages;
  uint64_t token =
      Watchdog::instance().watch({"broadcast #1 on 'world' (fake)", std::chrono::milliseconds(300),
                                  [] { return false; }, nullptr});
  auto [warning, timeout] = messages.wait();
  Watchdog::instance().unwatch(token);
  EXPECT_TRUE(std::regex_match(warning, std::regex("collective stall: broadcast #1 on 'world' "
                                                   "\\(fake\\) has been waiting [0-9.]+ s "
                                                   "\\(timeout 0\\.3 s\\)")))
      << warning;
  EXPECT_NE(timeout.find("within 0.3 s (rank"), std::string::npos) << timeout;
  EXPECT_NE(timeout.find("); a peer rank is stalled"), std::string::npos) << timeout;
}

}  // namespace
}  // namespace dtrain::dist
