// Checkpoint store: CRC-32C against published vectors and a bitwise reference, round trips,
// torch.load in Python reading the weights under nn.Module names, fault injection (crash
// mid-write, truncation, flipped bytes, unfinished saves), pruning, model checks (the rest:
// checkpoint_state_test.cc).
#include "checkpoint_test_util.h"
#include "dtrain/engine/parallel/tensor_parallel.h"

namespace dtrain::engine {
namespace {

using testing_util::run_python;

// ---- CRC-32C ----------------------------------------------------------------------------------

// The definition: one bit at a time, reflected Castagnoli polynomial.
uint32_t crc32c_bitwise(const std::vector<unsigned char>& data) {
  uint32_t crc = 0xFFFFFFFFu;
  for (unsigned char byte : data) {
    crc ^= byte;
    for (int k = 0; k < 8; ++k) crc = (crc >> 1) ^ (0x82F63B78u & (0u - (crc & 1u)));
  }
  return ~crc;
}

TEST(Crc32cTest, AllPathsAgreeWithTheDefinitionAtAnyLengthAndAlignment) {
  std::mt19937 gen(7);
  std::vector<unsigned char> buffer(300);
  for (auto& b : buffer) b = static_cast<unsigned char>(gen());
  for (size_t offset = 0; offset < 9; ++offset) {
    for (size_t n : {0, 1, 7, 8, 9, 15, 16, 17, 63, 64, 65, 200, 291}) {
      std::vector<unsigned char> piece(buffer.begin() + offset, buffer.begin() + offset + n);
      const uint32_t expected = crc32c_bitwise(piece);
      EXPECT_EQ(crc32c(buffer.data() + offset, n), expected) << offset << "+" << n;
      EXPECT_EQ(crc32c_portable(buffer.data() + offset, n), expected);
      // Streaming in two pieces gives the same value.
      const size_t half = n / 3;
      uint32_t c = crc32c(buffer.data() + offset, half);
      EXPECT_EQ(crc32c(buffer.data() + offset + half, n - half, c), expected);
    }
  }
}

// ---- fixtures ---------------------------------------------------------------------------------

// body: Linear(4, 8), BatchNorm1d(8), ReLU, Linear(8, 3); head: Linear(3, 2). The Python twin
// is MlpBn in tests/reference/load_checkpoint.py.
struct MlpBnImpl : torch::nn::Module {
  explicit MlpBnImpl(int64_t hidden = 8) {
    body = register_module(
        "body", torch::nn::Sequential(torch::nn::Linear(4, hidden), torch::nn::BatchNorm1d(hidden),
                                      torch::nn::ReLU(), torch::nn::Linear(hidden, 3)));
    head = register_module("head", torch::nn::Linear(3, 2));
  }
  torch::Tensor forward(const torch::Tensor& x) { return head->forward(body->forward(x)); }
  torch::nn::Sequential body{nullptr};
  torch::nn::Linear head{nullptr};
};
TORCH_MODULE(MlpBn);

CheckpointData sample_data(int64_t step) {
  torch::manual_seed(step);
  CheckpointData data;
  data.step = step;
  data.model = named({{"w", torch::randn({3, 4})}, {"b", torch::randn({3}, torch::kDouble)}});
  data.optimizer = named({{"0.step", torch::tensor(float(step))},
                          {"0.exp_avg", torch::randn({3, 4}).to(torch::kBFloat16)}});
  data.scaler = named(
      {{"scale", torch::full({1}, 65536.f)}, {"growth_tracker", torch::zeros({1}, torch::kInt)}});
  data.rng = capture_rng_state();
  data.meta = {{"schedule", "cosine"}, {"loader.train", "1,17"}};
  data.world_size = 4;
  data.dp_size = 2;
  return data;
}

void expect_same(const NamedTensors& a, const NamedTensors& b) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a[i].first, b[i].first);
    EXPECT_EQ(a[i].second.scalar_type(), b[i].second.scalar_type()) << a[i].first;
    EXPECT_TRUE(a[i].second.device().is_cpu());
    EXPECT_TRUE(at::equal(a[i].second, b[i].second.cpu())) << a[i].first;
  }
}

// ---- round trip and Python --------------------------------------------------------------------

TEST(CheckpointStoreTest, RoundTripKeepsEveryFieldExactly) {
  TempDir dir;
  CheckpointStore store(dir.path() + "/nested/ckpt");  // created on save
  CheckpointData data = sample_data(123);
  // A view into a larger storage and a non-contiguous tensor are saved as their own values.
  at::Tensor big = torch::arange(100000, torch::kFloat);
  data.model.emplace_back("view", big.narrow(0, 10, 5));
  data.model.emplace_back("transposed", torch::randn({2, 3}).t());
  const std::string path = store.save(data);
  EXPECT_EQ(path, dir.path() + "/nested/ckpt/step-000123.pt");
  EXPECT_LT(file_size(path), 40000u);  // not the view's whole 400 kB storage

  CheckpointData back = store.load(path);
  EXPECT_EQ(back.step, 123);
  expect_same(back.model, data.model);
  expect_same(back.optimizer, data.optimizer);
  expect_same(back.scaler, data.scaler);
  EXPECT_EQ(back.meta, data.meta);
  EXPECT_EQ(back.world_size, 4);
  EXPECT_EQ(back.dp_size, 2);
  EXPECT_EQ(back.rank_files, 0);
  ASSERT_TRUE(back.rng.cpu.defined());
  EXPECT_TRUE(at::equal(back.rng.cpu, data.rng.cpu));
  EXPECT_EQ(back.rng.cuda.size(), data.rng.cuda.size());

  std::optional<CheckpointInfo> latest = store.latest_good();
  ASSERT_TRUE(latest.has_value());
  EXPECT_EQ(latest->step, 123);
  EXPECT_EQ(latest->path, path);
  // The record: format, version, CRC-32C of the file's bytes, size, rank files.
  std::ifstream record_in(path + ".crc");
  std::string record((std::istreambuf_iterator<char>(record_in)), {});
  std::ifstream file_in(path, std::ios::binary);
  std::string bytes((std::istreambuf_iterator<char>(file_in)), {});
  char expected[128];
  std::snprintf(expected, sizeof(expected),
                "dtrain.checkpoint 1 crc32c=%08x bytes=%zu rank_files=0\n",
                crc32c(bytes.data(), bytes.size()), bytes.size());
  EXPECT_EQ(record, expected);
  EXPECT_EQ(dir.names(), std::vector<std::string>{"nested"});
}

TEST(CheckpointStoreTest, PythonLoadsTheWeightsUnderNnModuleNames) {
  TempDir dir;
  torch::manual_seed(3);
  MlpBn net;
  net->train();
  net->forward(torch::randn({16, 4}));  // moves BatchNorm's running statistics
  net->eval();
  CheckpointData data;
  data.step = 7;
  data.model = model_state(*net);
  data.meta = {{"program", "unit test"}};
  CheckpointStore store(dir.path());
  const std::string path = store.save(data);

  nlohmann::json out =
      nlohmann::json::parse(run_python("tests/reference/load_checkpoint.py", {path, "mlp_bn"}));
  std::vector<std::string> names;
  for (const auto& [name, tensor] : data.model) names.push_back(name);
  // The file's names are exactly those of the equivalent nn.Module, in its state_dict order.
  EXPECT_EQ(out["module_names"].get<std::vector<std::string>>(), names);
  ASSERT_EQ(out["entries"].size(), names.size());
  for (size_t i = 0; i < names.size(); ++i) {
    const auto& e = out["entries"][i];
    EXPECT_EQ(e["name"], names[i]);
    const at::Tensor& t = data.model[i].second;
    EXPECT_EQ(e["shape"].get<std::vector<int64_t>>(), t.sizes().vec()) << names[i];
    EXPECT_DOUBLE_EQ(e["sum"].get<double>(), t.to(torch::kDouble).sum().item<double>()) << names[i];
  }
  EXPECT_EQ(out["entries"][6]["name"], "body.1.num_batches_tracked");
  EXPECT_EQ(out["entries"][6]["dtype"], "int64");
  EXPECT_EQ(out["step"], 7);
  EXPECT_EQ(out["meta"]["program"], "unit test");
  EXPECT_EQ(out["keys"],
            nlohmann::json({"dp_size", "format", "kind", "meta", "model", "optimizer", "rank_files",
                            "rng", "scaler", "step", "version", "world_size"}));
  // PyTorch's module with the loaded weights computes what this module computes.
  torch::NoGradGuard no_grad;
  at::Tensor x = torch::linspace(-2.0, 2.0, 20, torch::kFloat).reshape({5, 4});
  at::Tensor y = net->forward(x).to(torch::kDouble).flatten();
  at::Tensor py = torch::tensor(out["output"].get<std::vector<double>>(), torch::kDouble);
  EXPECT_LT(testing_util::rel_error(y, py), 1e-6);
}

// ---- faults -----------------------------------------------------------------------------------

// The POSIX file system with injected failures: after `crash_after_bytes` bytes appended to
// a file whose name contains crash_name, or at a rename whose target contains crash_rename,
// it "crashes": that call and every later one throws, as if the process had died there.
class FaultyFileSystem : public FileSystem {
 public:
  std::string crash_name;
  int64_t crash_after_bytes = -1;
  std::string crash_rename;
  bool crashed = false;

  std::unique_ptr<WritableFile> new_writable_file(const std::string& path) override {
    check();
    struct File : WritableFile {
      FaultyFileSystem* owner;
      std::unique_ptr<WritableFile> inner;
      bool watched;
      int64_t written = 0;
      void append(const char* data, size_t n) override {
        owner->check();
        if (watched && owner->crash_after_bytes >= 0 &&
            written + static_cast<int64_t>(n) > owner->crash_after_bytes) {
          inner->append(data, static_cast<size_t>(owner->crash_after_bytes - written));
          owner->crashed = true;
          owner->check();
        }
        inner->append(data, n);
        written += static_cast<int64_t>(n);
      }
      void sync() override {
        owner->check();
        inner->sync();
      }
      void close() override {
        owner->check();
        inner->close();
      }
    };
    auto file = std::make_unique<File>();
    file->owner = this;
    file->inner = base()->new_writable_file(path);
    file->watched = !crash_name.empty() && contains(path, crash_name);
    return file;
  }
  std::unique_ptr<ReadableFile> new_readable_file(const std::string& path) override {
    check();
    return base()->new_readable_file(path);
  }
  bool exists(const std::string& path) override {
    check();
    return base()->exists(path);
  }
  uint64_t file_size(const std::string& path) override {
    check();
    return base()->file_size(path);
  }
  std::vector<std::string> list_dir(const std::string& dir) override {
    check();
    return base()->list_dir(dir);
  }
  void create_dirs(const std::string& dir) override {
    check();
    base()->create_dirs(dir);
  }
  void rename(const std::string& from, const std::string& to) override {
    check();
    if (!crash_rename.empty() && contains(to, crash_rename)) {
      crashed = true;
      check();
    }
    base()->rename(from, to);
  }
  void remove(const std::string& path) override {
    check();
    base()->remove(path);
  }
  void sync_dir(const std::string& dir) override {
    check();
    base()->sync_dir(dir);
  }

  void check() const {
    if (crashed) throw std::runtime_error("injected crash");
  }

 private:
  static FileSystem* base() { return default_file_system(); }
};

void truncate_file(const std::string& path, uint64_t size) {
  ASSERT_EQ(::truncate(path.c_str(), static_cast<off_t>(size)), 0) << path;
}

void flip_byte(const std::string& path, uint64_t offset) {
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  f.seekg(static_cast<std::streamoff>(offset));
  char c = 0;
  f.read(&c, 1);
  c = static_cast<char>(c ^ 0x20);
  f.seekp(static_cast<std::streamoff>(offset));
  f.write(&c, 1);
}

TEST(CheckpointStoreTest, TruncatedOrCorruptFilesAreSkippedForThePreviousOne) {
  TempDir dir;
  CheckpointStore store(dir.path());
  for (int64_t step : {10, 20, 30}) store.save(sample_data(step));
  ASSERT_EQ(store.latest_good()->step, 30);

  const std::string p30 = store.path_for(30);
  truncate_file(p30, file_size(p30) / 2);
  std::vector<std::string> skipped;
  std::optional<CheckpointInfo> latest = store.latest_good(&skipped);
  ASSERT_TRUE(latest.has_value());
  EXPECT_EQ(latest->step, 20);
  ASSERT_EQ(skipped.size(), 1u);
  EXPECT_TRUE(contains(skipped[0], p30 + ": truncated: ")) << skipped[0];
  EXPECT_TRUE(contains(message_of([&] { store.load(p30); }),
                       "cannot load checkpoint " + p30 + ": truncated"));

  const std::string p20 = store.path_for(20);
  flip_byte(p20, file_size(p20) / 2);
  skipped.clear();
  EXPECT_EQ(store.latest_good(&skipped)->step, 10);
  ASSERT_EQ(skipped.size(), 2u);
  EXPECT_TRUE(contains(skipped[1], p20 + ": checksum mismatch: crc32c ")) << skipped[1];
  EXPECT_TRUE(contains(skipped[1], "(the file is corrupt)")) << skipped[1];
  EXPECT_TRUE(contains(message_of([&] { store.load(p20); }), "checksum mismatch"));
  // The survivor loads.
  EXPECT_EQ(store.load(store.latest_good()->path).step, 10);
  // Nothing good at all: nullopt, not an error.
  flip_byte(store.path_for(10), 100);
  EXPECT_FALSE(store.latest_good().has_value());
  EXPECT_FALSE(CheckpointStore(dir.file("none")).latest_good().has_value());
}

TEST(CheckpointStoreTest, CrashMidWriteLeavesTheLastGoodCheckpoint) {
  TempDir dir;
  CheckpointStore(dir.path()).save(sample_data(1));
  FaultyFileSystem faulty;
  faulty.crash_name = "step-000002.pt.tmp.";
  faulty.crash_after_bytes = 300;
  CheckpointStoreOptions options;
  options.fs = &faulty;
  CheckpointStore crashing(dir.path(), options);
  EXPECT_TRUE(contains(message_of([&] { crashing.save(sample_data(2)); }), "injected crash"));
  // As after a real crash: the partial temporary file is still there, nothing was renamed.
  std::vector<std::string> names = dir.names();
  ASSERT_EQ(names.size(), 3u);
  EXPECT_EQ(names[0], "step-000001.pt");
  EXPECT_EQ(names[1], "step-000001.pt.crc");
  EXPECT_EQ(names[2].rfind("step-000002.pt.tmp.", 0), 0u) << names[2];
  EXPECT_EQ(file_size(dir.file(names[2])), 300u);

  CheckpointStore store(dir.path());  // the restarted job
  EXPECT_EQ(store.latest_good()->step, 1);
  // The next save removes the leftovers of the crashed one.
  store.save(sample_data(3));
  EXPECT_EQ(dir.names(), (std::vector<std::string>{"step-000001.pt", "step-000001.pt.crc",
                                                   "step-000003.pt", "step-000003.pt.crc"}));
}

TEST(CheckpointStoreTest, CrashBeforeTheRecordLeavesAnUncommittedFile) {
  TempDir dir;
  CheckpointStore(dir.path()).save(sample_data(5));
  FaultyFileSystem faulty;
  faulty.crash_rename = "step-000006.pt.crc";
  CheckpointStoreOptions options;
  options.fs = &faulty;
  EXPECT_THROW(CheckpointStore(dir.path(), options).save(sample_data(6)), Error);
  ASSERT_TRUE(exists(dir.file("step-000006.pt")));  // renamed, but never committed
  CheckpointStore store(dir.path());
  std::vector<std::string> skipped;
  EXPECT_EQ(store.latest_good(&skipped)->step, 5);
  ASSERT_EQ(skipped.size(), 1u);
  EXPECT_TRUE(contains(skipped[0],
                       "step-000006.pt: no checksum record step-000006.pt.crc (the "
                       "save did not finish)"))
      << skipped[0];
  EXPECT_EQ(store.list().size(), 1u);
}

TEST(CheckpointStoreTest, RankFilesArePartOfTheCheckpoint) {
  TempDir dir;
  CheckpointStore store(dir.path());
  CheckpointData data = sample_data(8);
  data.rank_files = 2;
  EXPECT_TRUE(contains(message_of([&] { store.save(data); }),
                       "rank file " + store.rank_path_for(8, 0) + " has no record"));
  EXPECT_FALSE(exists(store.path_for(8)));  // refused before writing anything
  for (int r = 0; r < 2; ++r) {
    RankState state;
    state.rank = r;
    state.dp_rank = r;
    state.dp_size = 2;
    state.optimizer_shard.layout = {6, {{3 * r, 3 * r + 3}}};
    state.optimizer_shard.tensors = named({{"exp_avg", torch::full({3}, float(r))}});
    state.rng = capture_rng_state();
    state.meta = {{"host", "h" + std::to_string(r)}};
    EXPECT_EQ(store.save_rank(8, state), dir.file("step-000008.rank-" + std::to_string(r) + ".pt"));
  }
  store.save(data);
  RankState back = store.load_rank(8, 1);
  EXPECT_EQ(back.rank, 1);
  EXPECT_EQ(back.dp_rank, 1);
  EXPECT_EQ(back.optimizer_shard.layout.numel, 6);
  EXPECT_TRUE(back.optimizer_shard.layout.ranges == (std::vector<FlatRange>{{3, 6}}));
  EXPECT_EQ(back.meta.at("host"), "h1");
  expect_same(back.optimizer_shard.tensors, named({{"exp_avg", torch::full({3}, 1.f)}}));
  EXPECT_EQ(store.latest_good()->rank_files, 2);

  ::unlink(store.rank_path_for(8, 1).c_str());
  std::vector<std::string> skipped;
  EXPECT_FALSE(store.latest_good(&skipped).has_value());
  ASSERT_EQ(skipped.size(), 1u);
  EXPECT_TRUE(contains(skipped[0], store.rank_path_for(8, 1) + ": the file is missing"))
      << skipped[0];
}

// Pipeline stages save their own layers: stage 0's in the main file, stage s's in the rank file
// of world rank s * (world / stages); load() gives the whole model back in stage order.
TEST(CheckpointStoreTest, PipelineStagesPartsAreLoadedAsTheWholeModel) {
  TempDir dir;
  CheckpointStore store(dir.path());
  CheckpointData data;
  data.step = 4;
  data.world_size = 4;  // 2 stages x 2 data-parallel ranks
  data.dp_size = 2;
  data.rank_files = 4;
  data.meta = {{"pp", "2"}};
  data.model = named({{"wte.weight", torch::full({2, 3}, 1.f)}, {"blocks.0.w", torch::full({3}, 2.f)}});
  data.optimizer = named({{"0.exp_avg", torch::full({2, 3}, 3.f)}, {"1.exp_avg", torch::full({3}, 4.f)}});
  for (int r = 0; r < 4; ++r) {
    RankState state;
    state.rank = r;
    state.dp_rank = r % 2;
    state.dp_size = 2;
    if (r == 2) {
      state.stage_model = named({{"blocks.1.w", torch::full({3}, 5.f)}, {"head.weight", torch::full({4, 3}, 6.f)}});
      state.stage_optimizer = named({{"2.exp_avg", torch::full({3}, 7.f)}, {"3.exp_avg", torch::full({4, 3}, 8.f)}});
    }
    store.save_rank(4, state);
  }
  store.save(data);
  const CheckpointData back = store.load(store.path_for(4));
  expect_same(back.model, named({{"wte.weight", torch::full({2, 3}, 1.f)}, {"blocks.0.w", torch::full({3}, 2.f)},
                                 {"blocks.1.w", torch::full({3}, 5.f)}, {"head.weight", torch::full({4, 3}, 6.f)}}));
  expect_same(back.optimizer, named({{"0.exp_avg", torch::full({2, 3}, 3.f)}, {"1.exp_avg", torch::full({3}, 4.f)},
                                     {"2.exp_avg", torch::full({3}, 7.f)}, {"3.exp_avg", torch::full({4, 3}, 8.f)}}));
  EXPECT_TRUE(store.load_rank(4, 1).stage_model.empty());
  // A stage's rank file without its part is named.
  RankState empty;
  empty.rank = 2;
  empty.dp_size = 2;
  store.save_rank(4, empty);
  EXPECT_TRUE(contains(message_of([&] { store.load(store.path_for(4)); }), "holds no part of the model"));
}

TEST(CheckpointStoreTest, KeepLastPrunesOlderCheckpointsAndOrphans) {
  TempDir dir;
  CheckpointStoreOptions options;
  options.keep_last = 2;
  CheckpointStore store(dir.path(), options);
  RankState orphan;  // a rank file of a collective save that never committed
  store.save_rank(2, orphan);
  for (int64_t step = 1; step <= 5; ++step) store.save(sample_data(step));
  EXPECT_EQ(dir.names(), (std::vector<std::string>{"step-000004.pt", "step-000004.pt.crc",
                                                   "step-000005.pt", "step-000005.pt.crc"}));
  std::vector<CheckpointInfo> listed = store.list();
  ASSERT_EQ(listed.size(), 2u);
  EXPECT_EQ(listed[0].step, 5);
  EXPECT_EQ(listed[1].step, 4);
  EXPECT_THROW(CheckpointStore(dir.path(), {-1, nullptr}), Error);
}

TEST(CheckpointStoreTest, BadFilesAreRefusedWithTheirName) {
  TempDir dir;
  CheckpointStore store(dir.path());
  EXPECT_TRUE(
      contains(message_of([&] { store.load(store.path_for(4)); }),
               "cannot load checkpoint " + store.path_for(4) + ": the file does not exist"));
  // Bytes that are not a torch archive, with a valid record.
  const std::string junk = "not a zip archive";
  std::ofstream(store.path_for(4)) << junk;
  std::ofstream(store.path_for(4) + ".crc")
      << ckpt_detail::format_record({crc32c(junk.data(), junk.size()), junk.size(), 0});
  EXPECT_TRUE(contains(message_of([&] { store.load(store.path_for(4)); }),
                       store.path_for(4) + " is not a readable torch archive"));
  std::ofstream(store.path_for(4) + ".crc") << "garbage\n";
  EXPECT_TRUE(contains(message_of([&] { store.load(store.path_for(4)); }),
                       "checksum record step-000004.pt.crc is malformed"));
  EXPECT_THROW(CheckpointStore(""), Error);
  CheckpointData bad = sample_data(1);
  bad.model.emplace_back("w", torch::zeros({1}));
  EXPECT_TRUE(contains(message_of([&] { store.save(bad); }), "has the name 'w' twice"));
  EXPECT_FALSE(exists(store.path_for(1)));
}

TEST(CheckpointStoreTest, FileNamesAndRecordsParse) {
  using ckpt_detail::FileName;
  auto parsed = ckpt_detail::parse_file_name("step-000120.rank-3.pt.crc");
  ASSERT_TRUE(parsed);
  EXPECT_EQ(parsed->kind, FileName::kRankRecord);
  EXPECT_EQ(parsed->step, 120);
  EXPECT_EQ(parsed->rank, 3);
  EXPECT_EQ(ckpt_detail::parse_file_name("step-1234567.pt")->step, 1234567);
  EXPECT_EQ(ckpt_detail::parse_file_name("step-000001.pt.crc.tmp.99")->kind, FileName::kTemp);
  EXPECT_FALSE(ckpt_detail::parse_file_name("step-.pt"));
  EXPECT_FALSE(ckpt_detail::parse_file_name("notes.txt"));
  EXPECT_FALSE(ckpt_detail::parse_file_name("step-1.pt.bak"));
  auto record = ckpt_detail::parse_record(ckpt_detail::format_record({0xDEADBEEF, 42, 3}));
  ASSERT_TRUE(record);
  EXPECT_EQ(record->crc, 0xDEADBEEFu);
  EXPECT_EQ(record->bytes, 42u);
  EXPECT_EQ(record->rank_files, 3);
  EXPECT_FALSE(ckpt_detail::parse_record("dtrain.checkpoint 2 crc32c=0 bytes=1 rank_files=0\n"));
}

// ---- model compatibility ------------------------------------------------------------------------

TEST(ModelStateTest, LoadsIntoTheSameModelAndRefusesAnother) {
  torch::manual_seed(1);
  MlpBn source;
  torch::manual_seed(2);
  MlpBn target;
  load_model_state(*target, model_state(*source), "step-000001.pt");
  for (const auto& [name, tensor] : model_state(*target)) {
    const auto src = model_state(*source);
    auto it = std::find_if(src.begin(), src.end(), [&](const auto& e) { return e.first == name; });
    EXPECT_TRUE(at::equal(tensor, it->second)) << name;
  }

  MlpBn wider(16);
  const NamedTensors before = model_state(*wider);
  std::vector<at::Tensor> snapshot;
  for (const auto& [name, t] : before) snapshot.push_back(t.clone());
  std::string message =
      message_of([&] { load_model_state(*wider, model_state(*source), "step-000001.pt"); });
  EXPECT_EQ(message,
            "checkpoint step-000001.pt is of a different model: 'body.0.weight' has shape [8, 4] "
            "there but [16, 4] here");
  // Nothing was changed.
  const NamedTensors after = model_state(*wider);
  for (size_t i = 0; i < after.size(); ++i) EXPECT_TRUE(at::equal(after[i].second, snapshot[i]));

  NamedTensors missing = model_state(*source);
  missing.erase(missing.begin() + 2);  // body.1.weight
  EXPECT_TRUE(contains(message_of([&] { load_model_state(*target, missing, "c.pt"); }),
                       "'body.1.weight' of this model is missing from it"));
  NamedTensors extra = model_state(*source);
  extra.emplace_back("tail.weight", torch::zeros({1}));
  EXPECT_TRUE(contains(message_of([&] { load_model_state(*target, extra, "c.pt"); }),
                       "it has 'tail.weight', which this model does not"));
  EXPECT_TRUE(
      contains(message_of([&] {
                 check_same_layout(named({{"0.exp_avg", torch::zeros({2})}}),
                                   named({{"0.exp_avg", torch::zeros({3})}}), "optimizer", "c.pt");
               }),
               "c.pt is of a different optimizer: '0.exp_avg' has shape [3] there but [2]"));
}

// A model that ties two names to one tensor (a head sharing the embedding's weight) loads a
// tied checkpoint (both entries equal) and refuses an untied one, whose second tensor would
// otherwise overwrite the first; the refused load leaves the model as it was.
TEST(ModelStateTest, TiedWeightsRefuseAnUntiedCheckpoint) {
  struct Tied : torch::nn::Module {
    Tied() {
      at::Tensor w = torch::randn({6, 4});
      register_parameter("embed", w);
      register_parameter("head", w);  // one tensor, two names
    }
  };
  torch::manual_seed(3);
  Tied model;
  const at::Tensor a = torch::randn({6, 4}), b = torch::randn({6, 4});
  load_model_state(model, named({{"embed", a}, {"head", a.clone()}}), "tied.pt");
  EXPECT_TRUE(at::equal(model.named_parameters()["embed"], a));
  const std::string message = message_of([&] { load_model_state(model, named({{"embed", b}, {"head", a}}), "u.pt"); });
  EXPECT_TRUE(contains(message, "checkpoint u.pt holds 'embed' and 'head' as two different tensors")) << message;
  EXPECT_TRUE(at::equal(model.named_parameters()["embed"], a));
}

// shard_of takes a whole tensor unpadded or padded and refuses any other size: a shorter one
// (a checkpoint of a smaller vocabulary) was zero-padded into the layer before.
TEST(ShardOfTest, RefusesATensorOfAnotherSize) {
  ShardSpec spec;
  spec.dim = 0;
  spec.full = 10;
  spec.padded = 12;
  EXPECT_EQ(shard_of(torch::ones({10, 3}), spec, 1, 2).sizes(), (std::vector<int64_t>{6, 3}));
  EXPECT_EQ(shard_of(torch::ones({12, 3}), spec, 0, 1).sizes(), (std::vector<int64_t>{12, 3}));
  for (int64_t rows : {8, 11, 14}) {
    EXPECT_TRUE(contains(message_of([&] { shard_of(torch::ones({rows, 3}), spec, 0, 2); }),
                         "does not fit a layer of 10 along dimension 0"))
        << rows;
  }
}

}  // namespace
}  // namespace dtrain::engine
