// DataLoader and TensorDataset in one process: sharding across ranks against one loader
// with the global batch, permutations, closed-form sizes of uneven last batches, worker
// ordering, failures, checkpoint positions, shutdown, validation.
#include "dtrain/engine/data/data.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <map>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "dtrain/dist/error.h"
#include "test_util.h"

namespace dtrain::engine {
namespace {

using Clock = std::chrono::steady_clock;

// Sample i has value i in field 0 (int64) and 0.5 * i in field 1 (float64).
std::shared_ptr<TensorDataset> counting_dataset(int64_t n) {
  at::Tensor ids = at::arange(n, at::kLong);
  return std::make_shared<TensorDataset>(std::vector<at::Tensor>{ids, ids.to(at::kDouble) * 0.5});
}

std::vector<int64_t> values(const Batch& b) {
  at::Tensor f = b.fields.at(0).cpu().contiguous();
  return std::vector<int64_t>(f.data_ptr<int64_t>(), f.data_ptr<int64_t>() + f.numel());
}

LoaderOptions opts(int64_t batch, int rank = 0, int size = 1, int workers = 0) {
  LoaderOptions o;
  o.batch_size = batch;
  o.dp_rank = rank;
  o.dp_size = size;
  o.workers = workers;
  o.seed = 1234;
  return o;
}

// The samples of `steps` successive next() calls.
std::vector<std::vector<int64_t>> take(DataLoader& loader, int64_t steps) {
  std::vector<std::vector<int64_t>> out;
  for (int64_t s = 0; s < steps; ++s) out.push_back(values(loader.next()));
  return out;
}

// A wrapper dataset: optional random sleep per call, optional failure on one sample.
class TestDataset : public Dataset {
 public:
  TestDataset(int64_t n, int max_sleep_ms, int64_t poison = -1)
      : inner_(counting_dataset(n)), max_sleep_ms_(max_sleep_ms), poison_(poison) {}
  int64_t size() const override { return inner_->size(); }
  std::vector<at::Tensor> get_batch(const std::vector<int64_t>& indices) const override {
    calls_.fetch_add(1);
    if (max_sleep_ms_ > 0) {
      thread_local std::mt19937 rng(std::hash<std::thread::id>()(std::this_thread::get_id()));
      std::this_thread::sleep_for(
          std::chrono::milliseconds(std::uniform_int_distribution<int>(0, max_sleep_ms_)(rng)));
    }
    for (int64_t i : indices) {
      if (i == poison_) throw Error("poisoned sample " + std::to_string(i));
    }
    return inner_->get_batch(indices);
  }
  mutable std::atomic<int64_t> calls_{0};

 private:
  std::shared_ptr<TensorDataset> inner_;
  int max_sleep_ms_;
  int64_t poison_;
};

// Expects `fn` to throw dtrain::Error whose message contains every one of `parts`.
template <typename Fn>
void expect_error(Fn fn, const std::vector<std::string>& parts) {
  try {
    fn();
    ADD_FAILURE() << "no dtrain::Error thrown; expected one mentioning " << parts.at(0);
  } catch (const Error& e) {
    const std::string m = e.what();
    for (const auto& p : parts) EXPECT_NE(m.find(p), std::string::npos) << m << "\nlacks: " << p;
  }
}

// (a) N ranks with batch b, concatenated in rank order, see step for step the samples of one
// rank with batch N * b, over two epochs, with and without drop_last.
TEST(DataSharding, RanksTogetherEqualOneLoaderWithTheGlobalBatch) {
  const int64_t n = 50, b = 3;
  for (bool drop_last : {true, false}) {
    for (int dp : {1, 2, 4}) {
      LoaderOptions whole = opts(dp * b);
      whole.drop_last = drop_last;
      DataLoader reference(counting_dataset(n), whole);
      std::vector<std::unique_ptr<DataLoader>> ranks;
      for (int r = 0; r < dp; ++r) {
        LoaderOptions o = opts(b, r, dp, /*workers=*/r % 2 + 1);
        o.drop_last = drop_last;
        ranks.push_back(std::make_unique<DataLoader>(counting_dataset(n), o));
        EXPECT_EQ(ranks.back()->batches_per_epoch(), reference.batches_per_epoch());
      }
      const int64_t steps = 2 * reference.batches_per_epoch();
      for (int64_t s = 0; s < steps; ++s) {
        Batch global = reference.next();
        std::vector<int64_t> joined;
        for (auto& loader : ranks) {
          Batch mine = loader->next();
          EXPECT_EQ(mine.epoch, global.epoch);
          EXPECT_EQ(mine.index, global.index);
          auto v = values(mine);
          joined.insert(joined.end(), v.begin(), v.end());
        }
        EXPECT_EQ(joined, values(global))
            << "dp " << dp << " step " << s << " drop_last " << drop_last;
      }
    }
  }
}

// (b) Each epoch visits distinct samples; with drop_last exactly N mod G are left out.
TEST(DataSharding, EveryEpochIsAPermutation) {
  const int64_t n = 53;
  for (bool drop_last : {true, false}) {
    for (int dp : {1, 2, 4}) {
      const int64_t b = 4, g = b * dp;
      std::vector<std::unique_ptr<DataLoader>> ranks;
      for (int r = 0; r < dp; ++r) {
        LoaderOptions o = opts(b, r, dp);
        o.drop_last = drop_last;
        ranks.push_back(std::make_unique<DataLoader>(counting_dataset(n), o));
      }
      const int64_t bpe = ranks[0]->batches_per_epoch();
      EXPECT_EQ(bpe, drop_last ? n / g : (n + g - 1) / g);
      for (int epoch = 0; epoch < 3; ++epoch) {
        std::vector<int64_t> seen;
        for (int64_t s = 0; s < bpe; ++s) {
          for (auto& loader : ranks) {
            auto v = values(loader->next());
            seen.insert(seen.end(), v.begin(), v.end());
          }
        }
        std::set<int64_t> distinct(seen.begin(), seen.end());
        EXPECT_EQ(distinct.size(), seen.size()) << "a sample repeats in epoch " << epoch;
        EXPECT_EQ(static_cast<int64_t>(seen.size()), drop_last ? n - n % g : n);
        EXPECT_GE(*distinct.begin(), 0);
        EXPECT_LT(*distinct.rbegin(), n);
      }
    }
  }
}

// (c) The order depends on seed and epoch, and on nothing else.
TEST(DataShuffle, SeedAndEpochDetermineTheOrder) {
  const int64_t n = 40;
  auto epoch_order = [&](uint64_t seed, int64_t epoch) {
    LoaderOptions o = opts(n);
    o.seed = seed;
    DataLoader loader(counting_dataset(n), o);
    loader.seek(epoch, 0);
    return values(loader.next());
  };
  std::vector<int64_t> identity(n);
  for (int64_t i = 0; i < n; ++i) identity[i] = i;
  const auto a = epoch_order(7, 0);
  EXPECT_EQ(a, epoch_order(7, 0));
  EXPECT_NE(a, identity);
  EXPECT_NE(a, epoch_order(8, 0));
  EXPECT_NE(a, epoch_order(7, 1));
  EXPECT_NE(epoch_order(7, 1), epoch_order(7, 2));
  EXPECT_NE(epoch_order(0, 0), epoch_order(1, 0));
  auto sorted = a;
  std::sort(sorted.begin(), sorted.end());
  EXPECT_EQ(sorted, identity);
}

// (c) Every ordering of 3 samples is equally likely over seeds (6000 draws, 6 outcomes:
// each count is 1000 +- 5 standard deviations of a binomial(6000, 1/6)).
TEST(DataShuffle, OrdersAreUniformOverSeeds) {
  std::map<std::vector<int64_t>, int> counts;
  const int draws = 6000;
  auto ds = counting_dataset(3);
  for (int s = 0; s < draws; ++s) {
    LoaderOptions o = opts(3);
    o.seed = static_cast<uint64_t>(s);
    DataLoader loader(ds, o);
    counts[values(loader.next())]++;
  }
  EXPECT_EQ(counts.size(), 6u);
  const double sd = std::sqrt(draws * (1.0 / 6) * (5.0 / 6));
  for (const auto& [order, c] : counts) EXPECT_NEAR(c, draws / 6.0, 5 * sd);
}

// (d) shuffle=false: dataset order, rank r at [r * b, (r + 1) * b) of each global batch.
TEST(DataShuffle, NoShuffleIsDatasetOrder) {
  const int64_t n = 24, b = 3;
  for (int dp : {1, 2}) {
    for (int r = 0; r < dp; ++r) {
      LoaderOptions o = opts(b, r, dp, /*workers=*/2);
      o.shuffle = false;
      DataLoader loader(counting_dataset(n), o);
      for (int64_t s = 0; s < 2 * loader.batches_per_epoch(); ++s) {
        const int64_t k = s % loader.batches_per_epoch();
        std::vector<int64_t> expected;
        for (int64_t j = 0; j < b; ++j) expected.push_back(k * b * dp + r * b + j);
        EXPECT_EQ(values(loader.next()), expected) << "dp " << dp << " rank " << r;
      }
    }
  }
}

// (e) drop_last=false: the last global batch of m samples is split in rank order, the first
// m % dp ranks taking one more; ranks beyond m get 0 rows.
TEST(DataSharding, UnevenLastBatchSizes) {
  struct Case {
    int64_t n, b;
    int dp;
    std::vector<int64_t> last_sizes;
  };
  const std::vector<Case> cases = {{10, 3, 2, {2, 2}},      {11, 3, 2, {3, 2}},
                                   {7, 2, 4, {2, 2, 2, 1}}, {18, 4, 4, {1, 1, 0, 0}},
                                   {5, 8, 1, {5}},          {3, 1, 4, {1, 1, 1, 0}}};
  for (const Case& c : cases) {
    const int64_t g = c.b * c.dp;
    int64_t offset = 0;  // first sample of rank r's share of the last batch (no shuffle)
    for (int r = 0; r < c.dp; ++r) {
      LoaderOptions o = opts(c.b, r, c.dp);
      o.drop_last = false;
      o.shuffle = false;
      DataLoader loader(counting_dataset(c.n), o);
      const int64_t bpe = (c.n + g - 1) / g;
      ASSERT_EQ(loader.batches_per_epoch(), bpe);
      for (int64_t k = 0; k + 1 < bpe; ++k) EXPECT_EQ(loader.next().size(), c.b);
      Batch last = loader.next();
      const int64_t m = c.last_sizes[r];
      EXPECT_EQ(last.size(), m) << "n " << c.n << " rank " << r;
      ASSERT_EQ(last.fields.size(), 2u);
      EXPECT_EQ(last.fields[1].size(0), m);
      EXPECT_EQ(last.fields[1].scalar_type(), at::kDouble);
      std::vector<int64_t> expected;
      for (int64_t j = 0; j < m; ++j) expected.push_back((bpe - 1) * g + offset + j);
      EXPECT_EQ(values(last), expected);
      offset += m;
      EXPECT_EQ(loader.next().epoch, 1);  // rolls over after the short batch
    }
  }
}

// (f) Any number of workers gives the same sequence, in order, even when get_batch takes a
// random time per call.
TEST(DataWorkers, SameSequenceForAnyWorkerCount) {
  const int64_t n = 40, steps = 24;
  std::vector<std::vector<std::vector<int64_t>>> runs;
  for (int workers : {0, 1, 3}) {
    LoaderOptions o = opts(4, /*rank=*/1, /*size=*/2, workers);
    o.prefetch = 4;
    DataLoader loader(std::make_shared<TestDataset>(n, /*max_sleep_ms=*/3), o);
    std::vector<std::pair<int64_t, int64_t>> positions;
    runs.push_back({});
    for (int64_t s = 0; s < steps; ++s) {
      Batch batch = loader.next();
      EXPECT_EQ(batch.epoch, s / loader.batches_per_epoch());
      EXPECT_EQ(batch.index, s % loader.batches_per_epoch());
      runs.back().push_back(values(batch));
    }
  }
  EXPECT_EQ(runs[0], runs[1]);
  EXPECT_EQ(runs[0], runs[2]);
}

// (f) Workers stay at most `prefetch` batches ahead of next().
TEST(DataWorkers, PrefetchBoundsTheWorkAhead) {
  auto ds = std::make_shared<TestDataset>(100, 0);
  LoaderOptions o = opts(2, 0, 1, /*workers=*/4);
  o.prefetch = 3;
  DataLoader loader(ds, o);
  auto settle_at = [&](int64_t expected) {
    const auto deadline = Clock::now() + std::chrono::seconds(5);
    while (ds->calls_.load() < expected && Clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));  // room to overshoot
    EXPECT_EQ(ds->calls_.load(), expected);
  };
  settle_at(3);
  loader.next();
  settle_at(4);
}

// (g) A failing get_batch surfaces from the next() for that batch; the stream goes on.
TEST(DataWorkers, DatasetFailureIsRethrownByNext) {
  const int64_t n = 20, b = 2, poison = 7;  // no shuffle: batch 3 holds sample 7
  for (int workers : {0, 2}) {
    LoaderOptions o = opts(b, 0, 1, workers);
    o.shuffle = false;
    DataLoader loader(std::make_shared<TestDataset>(n, 1, poison), o);
    for (int64_t k = 0; k < 3; ++k) EXPECT_EQ(loader.next().index, k);
    expect_error([&] { loader.next(); }, {"poisoned sample 7"});
    EXPECT_EQ(loader.position(), std::make_pair(int64_t{0}, int64_t{4}));
    EXPECT_EQ(values(loader.next()), (std::vector<int64_t>{8, 9}));
  }
}

// (g) A dataset breaking the get_batch contract is reported with the offending field.
TEST(DataWorkers, MalformedDatasetAnswerIsReported) {
  class Short : public Dataset {
   public:
    int64_t size() const override { return 10; }
    std::vector<at::Tensor> get_batch(const std::vector<int64_t>& idx) const override {
      return {at::zeros({static_cast<int64_t>(idx.size())}), at::zeros({1})};
    }
  };
  for (int workers : {0, 1}) {
    DataLoader loader(std::make_shared<Short>(), opts(3, 0, 1, workers));
    expect_error([&] { loader.next(); }, {"field 1", "[1]", "3 indices"});
  }
}

// (h) position() names the next batch; a new loader seeking there continues identically.
TEST(DataCheckpoint, SeekToPositionReproducesTheStream) {
  const int64_t n = 30;
  for (int workers : {0, 2}) {
    DataLoader a(counting_dataset(n), opts(4, 1, 2, workers));
    const int64_t bpe = a.batches_per_epoch();  // 3
    take(a, bpe + 1);
    const auto pos = a.position();
    EXPECT_EQ(pos, std::make_pair(int64_t{1}, int64_t{1}));
    const auto expected = take(a, 2 * bpe);
    DataLoader b(counting_dataset(n), opts(4, 1, 2, 3 - workers));
    take(b, 2);  // prefetched work is discarded by seek
    b.seek(pos.first, pos.second);
    EXPECT_EQ(b.position(), pos);
    EXPECT_EQ(take(b, 2 * bpe), expected);
    a.seek(0, 0);
    DataLoader fresh(counting_dataset(n), opts(4, 1, 2, 0));
    EXPECT_EQ(take(a, bpe), take(fresh, bpe));
    EXPECT_EQ(a.position(), std::make_pair(int64_t{1}, int64_t{0}));
  }
}

// (i) Destruction returns promptly: workers waiting for room, and workers inside a slow
// get_batch (bounded by one call).
TEST(DataWorkers, DestructorDoesNotWaitForTheBacklog) {
  {
    auto start = Clock::now();
    {
      LoaderOptions o = opts(2, 0, 1, /*workers=*/4);
      o.prefetch = 2;
      DataLoader loader(counting_dataset(100), o);
      loader.next();
      std::this_thread::sleep_for(std::chrono::milliseconds(50));  // queue full, workers idle
      start = Clock::now();
    }
    EXPECT_LT(Clock::now() - start, std::chrono::milliseconds(500));
  }
  class Slow : public Dataset {
   public:
    int64_t size() const override { return 100; }
    std::vector<at::Tensor> get_batch(const std::vector<int64_t>& idx) const override {
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
      return {at::zeros({static_cast<int64_t>(idx.size())})};
    }
  };
  auto start = Clock::now();
  {
    LoaderOptions o = opts(2, 0, 1, /*workers=*/3);
    o.prefetch = 8;
    DataLoader loader(std::make_shared<Slow>(), o);
    loader.next();  // ~200 ms; the three workers are then inside their next calls
    start = Clock::now();
  }
  // Finishing the backlog (8 batches on 3 workers, 3 rounds) would take >= 600 ms; the calls
  // under way end within 200 ms.
  EXPECT_LT(Clock::now() - start, std::chrono::milliseconds(550));
}

// (k) Fields of different dtypes and shapes stay aligned sample by sample.
TEST(DataDataset, MultiFieldBatchesStayAligned) {
  const int64_t n = 32;
  at::Tensor target = at::arange(n, at::kLong);
  at::Tensor input =
      target.to(at::kFloat).view({n, 1, 1}) + at::arange(6, at::kFloat).view({1, 2, 3}) / 10;
  at::Tensor mask = (target % 3 == 0);
  auto ds = std::make_shared<TensorDataset>(std::vector<at::Tensor>{input, target, mask});
  DataLoader loader(ds, opts(5, 0, 1, 2));
  for (int s = 0; s < 8; ++s) {
    Batch batch = loader.next();
    ASSERT_EQ(batch.fields.size(), 3u);
    const at::Tensor& x = batch.fields[0];
    const at::Tensor& y = batch.fields[1];
    EXPECT_EQ(x.scalar_type(), at::kFloat);
    EXPECT_EQ(y.scalar_type(), at::kLong);
    EXPECT_EQ(batch.fields[2].scalar_type(), at::kBool);
    EXPECT_EQ(x.sizes(), (std::vector<int64_t>{5, 2, 3}));
    EXPECT_TRUE(at::equal(x, input.index_select(0, y)));
    EXPECT_TRUE(at::equal(batch.fields[2], y % 3 == 0));
  }
}

TEST(DataDataset, TensorDatasetGathersRowsAndChecksIndices) {
  auto ds = counting_dataset(10);
  EXPECT_EQ(ds->size(), 10);
  auto f = ds->get_batch({9, 0, 4, 4});
  EXPECT_TRUE(at::equal(f[0], at::tensor(std::vector<int64_t>{9, 0, 4, 4})));
  EXPECT_TRUE(at::equal(f[1], at::tensor(std::vector<double>{4.5, 0, 2, 2})));
  EXPECT_EQ(ds->get_batch({})[1].sizes(), (std::vector<int64_t>{0}));
  expect_error([&] { ds->get_batch({3, 10}); }, {"index 10", "[0, 10)"});
  expect_error([&] { ds->get_batch({-1}); }, {"index -1"});
}

// (j) Every validation error names the bad value and the fix.
TEST(DataValidation, TensorDatasetRejectsBadFields) {
  expect_error([] { TensorDataset({}); }, {"at least one field"});
  expect_error([] { TensorDataset({at::zeros({3}), at::Tensor()}); }, {"field 1", "undefined"});
  expect_error([] { TensorDataset({at::zeros({})}); }, {"field 0", "0-dim"});
  expect_error(
      [] {
        TensorDataset({at::zeros({3}), at::zeros({4, 2})});
      },
      {"field 1 has 4 samples", "field 0 has 3"});
}

TEST(DataValidation, LoaderRejectsBadOptions) {
  auto ds = counting_dataset(10);
  auto make = [&](LoaderOptions o) { return [ds, o] { DataLoader loader(ds, o); }; };
  LoaderOptions o = opts(2);
  o.batch_size = 0;
  expect_error(make(o), {"batch_size = 0", "at least 1"});
  o = opts(2, 0, 0);
  expect_error(make(o), {"dp_size = 0"});
  o = opts(2, 2, 2);
  expect_error(make(o), {"dp_rank = 2", "[0, dp_size = 2)"});
  o = opts(2, -1, 2);
  expect_error(make(o), {"dp_rank = -1"});
  o = opts(2, 0, 1, -1);
  expect_error(make(o), {"workers = -1"});
  o = opts(2);
  o.prefetch = 0;
  expect_error(make(o), {"prefetch = 0", "at least 1"});
  o = opts(4, 0, 3);
  expect_error(make(o), {"10 samples", "= 12", "drop_last = false"});
  o.drop_last = false;
  EXPECT_NO_THROW(make(o)());
  expect_error([] { DataLoader loader(nullptr, opts(1)); }, {"dataset is null"});
  auto empty = std::make_shared<TensorDataset>(std::vector<at::Tensor>{at::zeros({0})});
  o = opts(1);
  o.drop_last = false;
  expect_error([&] { DataLoader loader(empty, o); }, {"empty", "size() = 0"});
  o = opts(1);
  o.device = c10::Device(c10::kMeta);
  expect_error(make(o), {"device meta", "CPU or CUDA"});
  if (!testing_util::has_cuda()) {
    o.device = c10::Device(c10::kCUDA, 0);
    expect_error(make(o), {"cuda:0", "no CUDA GPU", "device = cpu"});
  }
}

TEST(DataValidation, SeekRejectsPositionsOutsideTheEpoch) {
  DataLoader loader(counting_dataset(10), opts(3));  // 3 batches per epoch
  expect_error([&] { loader.seek(-1, 0); }, {"epoch = -1"});
  expect_error([&] { loader.seek(0, 3); }, {"index = 3", "batches_per_epoch = 3"});
  expect_error([&] { loader.seek(0, -2); }, {"index = -2"});
  loader.seek(5, 2);
  Batch b = loader.next();
  EXPECT_EQ(b.epoch, 5);
  EXPECT_EQ(b.index, 2);
}

}  // namespace
}  // namespace dtrain::engine
