// Checkpoints beyond the store: re-sharding of flat (partitioned) state against the unsharded
// array, one run per checkpoint directory, RNG states, preemption flags and Slurm requeue
// through a stand-in scontrol, background saves, and evaluation-only trainers.
#include "checkpoint_test_util.h"

namespace dtrain::engine {
namespace {

// ---- partitioned state --------------------------------------------------------------------------

TEST(ShardLayoutTest, RangesFollowTheOffloadedOptimizersLayout) {
  // 200 elements over 4 ranks: padded to 256 (4 x 64), 64 each: the last rank holds 8 real ones.
  const int64_t ends[] = {64, 128, 192, 200};
  for (int r = 0; r < 4; ++r) {
    FlatRange s = shard_range(200, 4, r);
    EXPECT_EQ(s.begin, 64 * r);
    EXPECT_EQ(s.end, ends[r]);
    offload::ShardRange o = offload::shard_range(200, r, 4);  // the optimizer's own ranges
    EXPECT_EQ(s.begin, std::min<int64_t>(o.begin, 200));
    EXPECT_EQ(s.end, std::min<int64_t>(o.end, 200));
  }
  EXPECT_TRUE(shard_range(10, 4, 3) == (FlatRange{10, 10}));  // only padding
  EXPECT_EQ(overlapping_shards(200, 4, {{100, 150}}), (std::vector<int>{1, 2}));
  EXPECT_EQ(overlapping_shards(10, 4, {{0, 10}}), (std::vector<int>{0}));
  EXPECT_TRUE(overlapping_shards(10, 4, {{10, 10}}).empty());
  EXPECT_TRUE(overlapping_shards(10, 4, {}).empty());
  EXPECT_THROW(shard_range(10, 0, 0), Error);
  EXPECT_THROW(shard_range(10, 2, 2), Error);
  EXPECT_THROW(shard_range(-1, 2, 0), Error);
}

// The pieces `ranks` ranks save of arrays "exp_avg" = full and "exp_avg_sq" = 2 full, with a
// replicated "step", cut directly from the whole arrays (the reference).
std::vector<ShardState> saved_pieces(const at::Tensor& full, int ranks) {
  std::vector<ShardState> pieces;
  for (int r = 0; r < ranks; ++r) {
    ShardState piece;
    const FlatRange s = shard_range(full.numel(), ranks, r);
    piece.layout = {full.numel(), {s}};
    piece.tensors = named({{"step", torch::tensor(4.f)},
                           {"exp_avg", full.narrow(0, s.begin, s.size()).clone()},
                           {"exp_avg_sq", (2 * full).narrow(0, s.begin, s.size()).clone()}});
    pieces.push_back(piece);
  }
  return pieces;
}

TEST(ShardLayoutTest, AssemblingEqualsCuttingTheWholeArray) {
  for (int64_t numel : {0, 1, 7, 130, 300}) {
    at::Tensor full = torch::arange(numel, torch::kFloat) * 0.5f + 1.f;
    for (int old_ranks = 1; old_ranks <= 5; ++old_ranks) {
      std::vector<ShardState> old = saved_pieces(full, old_ranks);
      for (int new_ranks = 1; new_ranks <= 5; ++new_ranks) {
        for (int r = 0; r < new_ranks; ++r) {
          const ShardLayout target = shard_layout_of(numel, new_ranks, r);
          const FlatRange range = shard_range(numel, new_ranks, r);
          // Only the overlapping old pieces are given (one for the replicated entry if none).
          std::vector<ShardState> given;
          for (int j : overlapping_shards(numel, old_ranks, target.ranges)) given.push_back(old[j]);
          if (given.empty()) given.push_back(old[0]);
          ShardState got = assemble_shard(given, target);
          ASSERT_EQ(got.tensors.size(), 3u);
          EXPECT_TRUE(got.layout.ranges == target.ranges);
          EXPECT_EQ(got.layout.size(), range.size());
          EXPECT_EQ(got.tensors[0].second.item<float>(), 4.f);
          const std::string where = std::to_string(numel) + " elements, " + std::to_string(old_ranks) + " -> " +
                                    std::to_string(new_ranks) + " rank " + std::to_string(r);
          EXPECT_TRUE(at::equal(got.tensors[1].second, full.narrow(0, range.begin, range.size()))) << where;
          EXPECT_TRUE(at::equal(got.tensors[2].second, (2 * full).narrow(0, range.begin, range.size()))) << where;
        }
      }
    }
  }
}

TEST(ShardLayoutTest, AssemblyNamesWhatIsWrong) {
  at::Tensor full = torch::arange(300, torch::kFloat);
  std::vector<ShardState> old = saved_pieces(full, 3);  // [0, 128) [128, 256) [256, 300)
  const ShardLayout whole{300, {{0, 300}}};
  EXPECT_TRUE(contains(message_of([&] { assemble_shard({old[0], old[2]}, whole); }),
                       "no saved optimizer shard holds elements [128, 256) of this rank's [0, 300)"));
  EXPECT_TRUE(contains(message_of([&] { assemble_shard({old[0], old[1]}, whole); }),
                       "no saved optimizer shard holds elements [256, 300)"));
  std::vector<ShardState> bad = old;
  bad[1].tensors[0].second = torch::tensor(5.f);
  EXPECT_TRUE(contains(message_of([&] { assemble_shard(bad, whole); }), "the replicated entry 'step' differs"));
  bad = old;
  bad[1].tensors[1].second = torch::zeros({7});
  EXPECT_TRUE(contains(message_of([&] { assemble_shard(bad, whole); }),
                       "optimizer shard entry 'exp_avg' of [128, 256) has 7 elements; 128 were expected"));
  bad = old;
  bad[2].tensors[2].first = "sum";
  EXPECT_TRUE(contains(message_of([&] { assemble_shard(bad, whole); }), "hold different entries"));
  EXPECT_TRUE(contains(message_of([&] { assemble_shard(old, ShardLayout{301, {{0, 301}}}); }),
                       "holds partitioned state of 300 elements, but this model needs 301"));
}

TEST(ShardLayoutTest, LoadsOnlyTheNeededRankFilesAcrossTensorParallelRanks) {
  TempDir dir;
  CheckpointStore store(dir.path());
  // world 6 = dp 3 x tp 2; tensor-parallel rank t's flat array is 100*t + (0..299), saved in
  // ranges [0, 128) [128, 256) [256, 300).
  const int64_t numel = 300;
  CheckpointData main;
  main.step = 9;
  main.world_size = 6;
  main.dp_size = 3;
  main.rank_files = 6;
  for (int d = 0; d < 3; ++d) {
    for (int t = 0; t < 2; ++t) {
      RankState state;
      state.rank = d * 2 + t;
      state.dp_rank = d;
      state.dp_size = 3;
      state.tp_rank = t;
      state.optimizer_shard = saved_pieces(torch::arange(numel, torch::kFloat) + 100.f * t, 3)[d];
      store.save_rank(9, state);
    }
  }
  store.save(main);
  // New rank 1 of 2 holds [192, 300): old dp ranks 1 and 2 only.
  ::unlink(store.rank_path_for(9, 0 * 2 + 1).c_str());  // tp rank 1's dp-0 file is not needed
  const ShardLayout target = shard_layout_of(numel, 2, 1);
  ASSERT_TRUE(target.ranges == (std::vector<FlatRange>{{192, 300}}));
  ShardState got = load_resharded_optimizer(store, store.load(store.path_for(9)), /*tp_rank=*/1, target);
  ASSERT_EQ(got.tensors.size(), 3u);
  EXPECT_TRUE(at::equal(got.tensors[1].second, torch::arange(192, 300, torch::kFloat) + 100.f));
  EXPECT_TRUE(contains(message_of([&] {
                         load_resharded_optimizer(store, store.load(store.path_for(9)), 0,
                                                  shard_layout_of(301, 2, 1));
                       }),
                       "holds partitioned optimizer state of 300 elements, but this model needs 301"));
  EXPECT_TRUE(contains(message_of([&] { load_resharded_optimizer(store, store.load(store.path_for(9)), 2, target); }),
                       "tensor-parallel size 2; tensor-parallel rank 2 has no state there"));
}

// A checkpoint of `numels.size()` pipeline stages x dp data-parallel ranks (tp 1) whose
// partitioned state cuts the whole flat array `whole` stage by stage (each stage's part split
// over dp), with the stages' sizes recorded unless `record_sizes` is false.
CheckpointData save_staged(CheckpointStore& store, const at::Tensor& whole, const std::vector<int64_t>& numels, int dp,
                           bool record_sizes = true) {
  const int stages = static_cast<int>(numels.size());
  CheckpointData main;
  main.step = 5;
  main.world_size = stages * dp;
  main.dp_size = dp;
  main.rank_files = main.world_size;
  main.meta["pp"] = std::to_string(stages);
  std::string counts;
  int64_t offset = 0;
  for (int s = 0; s < stages; ++s) {
    counts += (s ? "," : "") + std::to_string(numels[s]);
    const std::vector<ShardState> pieces = saved_pieces(whole.narrow(0, offset, numels[s]), dp);
    for (int d = 0; d < dp; ++d) {
      RankState state;
      state.rank = s * dp + d;
      state.dp_rank = d;
      state.dp_size = dp;
      state.optimizer_shard = pieces[d];
      if (s > 0 && d == 0) state.stage_model = named({{"stage" + std::to_string(s) + ".w", torch::zeros({1})}});
      store.save_rank(main.step, state);
    }
    offset += numels[s];
  }
  if (record_sizes && stages > 1) main.meta["pp.flat_numel"] = counts;
  store.save(main);
  return store.load(store.path_for(main.step));
}

TEST(ShardLayoutTest, PartitionedStateReshardsAcrossPipelineSplits) {
  // The whole model's flat space is the stages' spaces end to end: 300 elements, saved as
  // stages of 130 + 170 over 2 data-parallel ranks each, or unsplit over 3.
  const at::Tensor whole = torch::arange(300, torch::kFloat) * 0.25f + 1.f;
  const std::vector<std::vector<int64_t>> splits = {{300}, {130, 170}, {100, 120, 80}, {50, 50, 100, 100}};
  for (const std::vector<int64_t>& old_split : {splits[1], splits[0], splits[2]}) {
    TempDir dir;
    CheckpointStore store(dir.path());
    const int old_dp = old_split.size() == 1 ? 3 : 2;
    const CheckpointData main = save_staged(store, whole, old_split, old_dp);
    for (const std::vector<int64_t>& new_split : splits) {
      const int stages = static_cast<int>(new_split.size());
      int64_t offset = 0;
      for (int s = 0; s < stages; ++s) {
        for (int dp : {1, 2, 3}) {
          for (int r = 0; r < dp; ++r) {
            const ShardLayout target = shard_layout_of(new_split[s], dp, r);
            const FlatRange range = shard_range(new_split[s], dp, r);
            const StageSpace space{s, stages, offset, 300};
            const ShardState got = load_resharded_optimizer(store, main, 0, target, space);
            ASSERT_EQ(got.tensors.size(), 3u);
            EXPECT_TRUE(got.layout.numel == target.numel && got.layout.ranges == target.ranges);
            EXPECT_EQ(got.tensors[0].second.item<float>(), 4.f);  // the replicated "step"
            const at::Tensor expected = whole.narrow(0, offset + range.begin, range.size());
            EXPECT_TRUE(at::equal(got.tensors[1].second, expected))
                << old_split.size() << " stages -> stage " << s << " of " << stages << ", rank " << r << " of " << dp;
            EXPECT_TRUE(at::equal(got.tensors[2].second, 2 * expected));
          }
        }
        offset += new_split[s];
      }
    }
    // A whole model of another size is another model.
    EXPECT_TRUE(contains(message_of([&] {
                           load_resharded_optimizer(store, main, 0, ShardLayout{170, {{0, 170}}}, StageSpace{1, 2, 130, 301});
                         }),
                         "but this model needs 301; it is of a different model"));
  }
  // Saved without the stages' sizes: only the same split resumes.
  TempDir dir;
  CheckpointStore store(dir.path());
  const CheckpointData legacy = save_staged(store, whole, splits[1], 2, /*record_sizes=*/false);
  const ShardState same = load_resharded_optimizer(store, legacy, 0, shard_layout_of(170, 1, 0),
                                                   StageSpace{1, 2, 130, 300});
  EXPECT_TRUE(at::equal(same.tensors[1].second, whole.narrow(0, 130, 170)));
  EXPECT_TRUE(contains(message_of([&] {
                         load_resharded_optimizer(store, legacy, 0, ShardLayout{100, {{0, 100}}}, StageSpace{0, 3, 0, 300});
                       }),
                       "of 2 pipeline stage(s) without their sizes; this run has 3. Resume it with --pp=2"));
}

// ---- one run per checkpoint directory -----------------------------------------------------------

TEST(DirectoryLockTest, SecondHolderIsRefusedNamingTheFirst) {
  TempDir dir;
  const std::string save = dir.path() + "/runs/a";  // created by the lock
  {
    DirectoryLock first(save);
    const std::string m = message_of([&] { DirectoryLock second(save); });
    EXPECT_TRUE(contains(m, "the checkpoint directory '" + save + "' is in use by another run (host ")) << m;
    EXPECT_TRUE(contains(m, "pid " + std::to_string(::getpid()) + ", since ")) << m;
    EXPECT_TRUE(contains(m, "one run per --save_dir")) << m;
  }
  EXPECT_NO_THROW({ DirectoryLock again(save); });  // released with its holder
}

TEST(DirectoryLockTest, AKilledHolderLeavesADirectoryTheNextRunLocks) {
  TempDir dir;
  int ready[2];
  ASSERT_EQ(::pipe(ready), 0);
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    DirectoryLock held(dir.path());
    char c = 'x';
    (void)!::write(ready[1], &c, 1);
    ::pause();  // until killed
    ::_exit(0);
  }
  char c = 0;
  ASSERT_EQ(::read(ready[0], &c, 1), 1);
  EXPECT_TRUE(contains(message_of([&] { DirectoryLock second(dir.path()); }), "pid " + std::to_string(child)));
  ::kill(child, SIGKILL);
  int status = 0;
  ::waitpid(child, &status, 0);
  EXPECT_NO_THROW({ DirectoryLock next(dir.path()); });
  ::close(ready[0]);
  ::close(ready[1]);
}

// ---- RNG ----------------------------------------------------------------------------------------

TEST(RngStateTest, RestoreReplaysTheSameRandomNumbers) {
  torch::manual_seed(11);
  RngState state = capture_rng_state();
  at::Tensor first = torch::randn({8});
  torch::manual_seed(99);
  restore_rng_state(state);
  EXPECT_TRUE(at::equal(torch::randn({8}), first));
  RngState bad;
  bad.cpu = torch::zeros({3}, torch::kByte);
  EXPECT_TRUE(contains(message_of([&] { restore_rng_state(bad); }),
                       "cannot restore the CPU random generator state"));
}

// ---- preemption ---------------------------------------------------------------------------------

TEST(PreemptionTest, SignalsOnlySetTheFlag) {
  install_preemption_handlers();
  install_preemption_handlers();  // idempotent
  clear_preemption_request();
  EXPECT_FALSE(preemption_requested());
  EXPECT_FALSE(agree_preempt(testing_util::world_comm()));
  ASSERT_EQ(::raise(SIGUSR1), 0);  // would end the process without the handler
  EXPECT_TRUE(preemption_requested());
  EXPECT_EQ(preemption_signal(), SIGUSR1);
  EXPECT_TRUE(agree_preempt(testing_util::world_comm()));
  clear_preemption_request();
  ASSERT_EQ(::raise(SIGTERM), 0);
  EXPECT_EQ(preemption_signal(), SIGTERM);
  clear_preemption_request();
}

// Sets or unsets an environment variable for the scope.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    const char* old = std::getenv(name);
    if (old) old_ = old;
    if (value) {
      ::setenv(name, value, 1);
    } else {
      ::unsetenv(name);
    }
  }
  ~ScopedEnv() {
    if (old_) {
      ::setenv(name_.c_str(), old_->c_str(), 1);
    } else {
      ::unsetenv(name_.c_str());
    }
  }

 private:
  std::string name_;
  std::optional<std::string> old_;
};

TEST(PreemptionTest, RequeueRunsScontrolOnlyInsideSlurm) {
  TempDir dir;
  const std::string fake = dir.file("scontrol");
  const std::string log = dir.file("args");
  std::ofstream(fake) << "#!/bin/sh\nprintf '%s|' \"$@\" > " << log << "\nexit ${FAKE_STATUS:-0}\n";
  ASSERT_EQ(::chmod(fake.c_str(), 0700), 0);
  RequeueOptions options;
  options.scontrol = fake;
  {
    ScopedEnv job("SLURM_JOB_ID", nullptr);
    RequeueResult r = request_requeue(options);
    EXPECT_FALSE(r.attempted);
    EXPECT_FALSE(exists(log));
  }
  ScopedEnv job("SLURM_JOB_ID", "4242");
  RequeueResult r = request_requeue(options);
  EXPECT_TRUE(r.ok()) << r.message;
  std::ifstream in(log);
  EXPECT_EQ(std::string((std::istreambuf_iterator<char>(in)), {}), "requeue|4242|");
  {
    ScopedEnv status("FAKE_STATUS", "3");
    r = request_requeue(options);
    EXPECT_FALSE(r.ok());
    EXPECT_EQ(r.exit_code, 3);
    EXPECT_TRUE(contains(r.message, "exited with status 3")) << r.message;
  }
  options.scontrol = dir.file("no-such-scontrol");
  r = request_requeue(options);
  EXPECT_EQ(r.exit_code, 127);
  std::ofstream(fake) << "#!/bin/sh\nsleep 5\n";
  options.scontrol = fake;
  options.timeout_s = 0.2;
  r = request_requeue(options);
  EXPECT_EQ(r.exit_code, -1);
  EXPECT_TRUE(contains(r.message, "did not finish in time")) << r.message;
}

// ---- async save (TrainerOptions::async_save) ---------------------------------------------------

// The POSIX file system with a hook called before each append: (path, bytes appended so far).
class HookedFileSystem final : public testing_util::ForwardingFileSystem {
 public:
  std::function<void(const std::string&, int64_t)> on_append;
  std::function<void(const std::string&)> on_close;
  std::unique_ptr<WritableFile> new_writable_file(const std::string& path) override {
    struct File : WritableFile {
      HookedFileSystem* owner;
      std::string path;
      std::unique_ptr<WritableFile> inner;
      int64_t written = 0;
      void append(const char* data, size_t n) override {
        if (owner->on_append) owner->on_append(path, written);
        inner->append(data, n);
        written += static_cast<int64_t>(n);
      }
      void sync() override { inner->sync(); }
      void close() override {
        inner->close();
        if (owner->on_close) owner->on_close(path);
      }
    };
    auto file = std::make_unique<File>();
    file->owner = this;
    file->path = path;
    file->inner = fs().new_writable_file(path);
    return file;
  }
};

// A 1-process training of 4 steps saving every 2 into dir through fs; on_log sees each step.
// poison_at_step > 0: a weight is set to NaN when that step is logged (before its save).
void train_saving(const std::string& dir, FileSystem* fs, bool async,
                  const std::function<void(const StepMetrics&)>& on_log = nullptr, int64_t poison_at_step = 0) {
  auto comm = dist::create_communicator("local", dist::World{}, c10::Device(c10::kCPU));
  dist::Mesh mesh(*comm, 1);
  torch::manual_seed(4);
  torch::nn::Linear model(8, 4);
  model->to(torch::kFloat64);
  TrainerOptions o;
  o.steps = 4;
  o.save_every = 2;
  o.save_dir = dir;
  o.checkpoint_fs = fs;
  o.async_save = async;
  o.log_every = 1;
  o.progress = false;
  o.handle_preemption = false;
  o.optimizer.name = "adam";
  o.optimizer.lr = 0.05;
  o.on_log = [&](const StepMetrics& m) {
    if (on_log) on_log(m);
    if (m.step == poison_at_step) {
      at::NoGradGuard no_grad;
      model->weight[1][2] = std::numeric_limits<double>::quiet_NaN();
    }
  };
  Trainer trainer(*model, [&](const Batch& b) { return torch::mse_loss(model->forward(b.fields[0]), b.fields[1]); },
                  mesh, c10::Device(c10::kCPU), o);
  auto g = at::make_generator<at::CPUGeneratorImpl>(2);
  auto data = std::make_shared<TensorDataset>(
      std::vector<at::Tensor>{at::randn({64, 8}, g, at::kDouble), at::randn({64, 4}, g, at::kDouble)});
  LoaderOptions lo;
  lo.batch_size = 8;
  lo.workers = 0;
  DataLoader loader(data, lo);
  trainer.fit(loader);
}

// The steps after a periodic save run while its files are written (the write of step 2 is
// slowed to 400 ms; step 3 is logged before it ends), and what is written is the state of the
// saving step, not of the steps that ran meanwhile: the files equal a synchronous run's.
TEST(AsyncSave, TrainingGoesOnWhileTheCheckpointIsWrittenAndTheFilesHoldTheSavingStep) {
  using Clock = std::chrono::steady_clock;
  TempDir async_dir, sync_dir;
  HookedFileSystem fs;
  std::mutex m;
  Clock::time_point step2_written{}, step3_logged{};
  bool slowed = false;
  fs.on_append = [&](const std::string& path, int64_t) {
    if (contains(path, "step-000002") && !slowed) {
      slowed = true;
      std::this_thread::sleep_for(std::chrono::milliseconds(400));
    }
  };
  fs.on_close = [&](const std::string& path) {
    std::lock_guard<std::mutex> lock(m);
    if (contains(path, "step-000002")) step2_written = Clock::now();
  };
  train_saving(async_dir.path(), &fs, /*async=*/true, [&](const StepMetrics& s) {
    std::lock_guard<std::mutex> lock(m);
    if (s.step == 3) step3_logged = Clock::now();
  });
  ASSERT_TRUE(slowed);
  EXPECT_LT(step3_logged.time_since_epoch().count(), step2_written.time_since_epoch().count())
      << "step 3 waited for the checkpoint of step 2 to be written";
  train_saving(sync_dir.path(), nullptr, /*async=*/false);
  CheckpointStore a(async_dir.path()), b(sync_dir.path());
  ASSERT_TRUE(a.latest_good().has_value());
  EXPECT_EQ(a.latest_good()->step, 4);
  for (int64_t step : {2, 4}) {
    CheckpointData x = a.load(a.path_for(step)), y = b.load(b.path_for(step));
    ASSERT_EQ(x.model.size(), y.model.size());
    for (size_t i = 0; i < x.model.size(); ++i) {
      EXPECT_TRUE(at::equal(x.model[i].second, y.model[i].second)) << "step " << step << " " << x.model[i].first;
    }
    ASSERT_EQ(x.optimizer.size(), y.optimizer.size());
    for (size_t i = 0; i < x.optimizer.size(); ++i) {
      EXPECT_TRUE(at::equal(x.optimizer[i].second, y.optimizer[i].second)) << "step " << step << " " << x.optimizer[i].first;
    }
  }
}

// Weights that are not finite are never saved, by the saving step (synchronous) or by the
// background writer (which reads the flag the saving step computed on the weights' device).
TEST(AsyncSave, NonFiniteWeightsAreNotSavedInTheBackgroundEither) {
  for (bool async : {false, true}) {
    SCOPED_TRACE(async ? "background save" : "synchronous save");
    TempDir dir;
    try {
      train_saving(dir.path(), nullptr, async, nullptr, /*poison_at_step=*/4);
      ADD_FAILURE() << "a checkpoint of NaN weights was saved";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("step 4: the weights are not finite on some rank"), std::string::npos)
          << e.what();
    }
    CheckpointStore store(dir.path());
    ASSERT_TRUE(store.latest_good().has_value());
    EXPECT_EQ(store.latest_good()->step, 2);
  }
}

TEST(HostStaging, AHostTensorIsCopiedAtOnceAndNoPinnedMemoryIsKept) {
  HostStaging staging;
  at::Tensor t = at::arange(5, at::kFloat);
  at::Tensor staged = staging.stage("t", t, HostStaging::kUntilNextUpdate);
  staging.seal();
  t.fill_(-1);
  staging.fence();
  staging.wait();
  EXPECT_TRUE(at::equal(staged, at::arange(5, at::kFloat)));
  EXPECT_EQ(staging.pinned_bytes(), 0);
}

// --eval_only: an evaluation-only trainer allocates no optimizer state or gradient buffers
// (counted by the CPU allocator against the tensors' byte sizes), evaluates exactly as a
// training trainer does, reads a checkpoint's weights while a training run holds the directory,
// and refuses to train or save.
TEST(EvaluationOnly, NoOptimizerStateNorGradientsAndTheSameEvaluationOfACheckpoint) {
  ASSERT_TRUE(cpu_memory_tracked());
  TempDir dir;
  auto comm = dist::create_communicator("local", dist::World{}, c10::Device(c10::kCPU));
  dist::Mesh mesh(*comm, 1);
  auto make_model = [] {
    torch::manual_seed(7);
    return torch::nn::Linear(512, 512);
  };
  torch::nn::Linear trained = make_model(), lean_model = make_model();
  auto data = std::make_shared<TensorDataset>(std::vector<at::Tensor>{at::randn({64, 512}), at::randn({64, 512})});
  LoaderOptions lo;
  lo.batch_size = 16;
  lo.workers = 0;
  auto options = [&](bool eval_only) {
    TrainerOptions o;
    o.steps = 3;
    o.optimizer.name = "adam";
    o.evaluation_only = eval_only;
    o.save_dir = dir.path();
    o.handle_preemption = false;
    o.progress = false;
    return o;
  };
  auto loss_of = [](torch::nn::Linear& m) {
    return [&m](const Batch& b) { return torch::mse_loss(m->forward(b.fields[0]), b.fields[1]); };
  };
  const double weights_mb = (512.0 * 512 + 512) * 4 / (1024 * 1024);
  double at = memory_stats(c10::Device(c10::kCPU)).allocated_mb;
  Trainer trainer(*trained, loss_of(trained), mesh, c10::Device(c10::kCPU), options(false));
  const double training_mb = memory_stats(c10::Device(c10::kCPU)).allocated_mb - at;
  DataLoader train(data, lo);
  trainer.fit(train);  // saves step 3; the trainer keeps holding the directory
  at = memory_stats(c10::Device(c10::kCPU)).allocated_mb;
  Trainer lean(*lean_model, loss_of(lean_model), mesh, c10::Device(c10::kCPU), options(true));
  const double lean_mb = memory_stats(c10::Device(c10::kCPU)).allocated_mb - at;
  EXPECT_GE(training_mb, 2.99 * weights_mb) << "gradients and Adam's two moments";
  EXPECT_LT(lean_mb, 0.05 * weights_mb) << "an evaluation-only trainer allocated state";
  ASSERT_TRUE(lean.resume_checkpoint(nullptr, /*required=*/true));
  EXPECT_EQ(lean.current_step(), 3);
  EXPECT_TRUE(at::equal(lean_model->weight, trained->weight));
  DataLoader a(data, lo), b(data, lo);
  EXPECT_EQ(lean.evaluate(a, 2), trainer.evaluate(b, 2));
  for (const auto& attempt : std::vector<std::function<void()>>{
           [&] { lean.step(a.next()); }, [&] { lean.fit(a); }, [&] { lean.save_checkpoint(nullptr); }}) {
    EXPECT_NE(testing_util::error_of(attempt).find("built for evaluation only"), std::string::npos);
  }
  // The same weights through load_weights(), no Trainer of the caller's (the directory stays
  // the training run's: nothing is locked or written).
  torch::nn::Linear loaded(512, 512);
  EXPECT_EQ(load_weights(dir.path(), *loaded, mesh, c10::Device(c10::kCPU)), 3);
  EXPECT_TRUE(at::equal(loaded->weight, trained->weight));
  EXPECT_TRUE(at::equal(loaded->bias, trained->bias));
  TempDir empty;
  EXPECT_NE(testing_util::error_of([&] { load_weights(empty.path(), *loaded, mesh, c10::Device(c10::kCPU)); })
                .find("'" + empty.path() + "' holds no good checkpoint"),
            std::string::npos);
  torch::nn::Linear other(512, 256);
  EXPECT_NE(testing_util::error_of([&] { load_weights(dir.path(), *other, mesh, c10::Device(c10::kCPU)); })
                .find("weight"),
            std::string::npos);
}

// The process killed while the background thread writes step 4: the checkpoint of step 2 is
// still the newest good one, and no file of step 4 counts.
TEST(AsyncSaveDeathTest, AKillDuringTheBackgroundWriteLeavesThePreviousCheckpoint) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  // The child re-runs this body from the start: it trains in the parent's directory, passed in
  // the environment it inherits.
  constexpr const char* kDirVar = "DTRAIN_TEST_ASYNC_KILL_DIR";
  std::optional<TempDir> own;
  std::string dir;
  if (const char* inherited = std::getenv(kDirVar)) {
    dir = inherited;
  } else {
    own.emplace();
    dir = own->path();
    ::setenv(kDirVar, dir.c_str(), 1);
  }
  HookedFileSystem fs;
  // The rank file of step 4 is written; the process dies as the main file starts.
  fs.on_append = [](const std::string& path, int64_t) {
    if (contains(path, "step-000004.pt")) std::_Exit(9);
  };
  EXPECT_EXIT(train_saving(dir, &fs, /*async=*/true), testing::ExitedWithCode(9), "");
  ::unsetenv(kDirVar);
  CheckpointStore store(dir);
  std::optional<CheckpointInfo> good = store.latest_good();
  ASSERT_TRUE(good.has_value());
  EXPECT_EQ(good->step, 2);
  store.load(good->path);  // whole and verified
}

}  // namespace
}  // namespace dtrain::engine