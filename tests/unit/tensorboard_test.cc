// TensorBoard event files: CRC-32C against published vectors, the TFRecord framing, and a
// 20-step run read back by TensorBoard's own Python reader (tests/reference/
// read_tensorboard.py: EventAccumulator, plus its CRC-checking record reader).
#include "dtrain/engine/observe/tensorboard.h"

#include <dirent.h>
#include <ftw.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "dtrain/dist/error.h"
#include "test_util.h"

namespace dtrain::engine {
namespace {

using nlohmann::json;
using testing_util::error_of;
using testing_util::ScratchDir;

bool event_dir_exists(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0;
}

std::vector<std::string> events_files(const std::string& dir) {
  std::vector<std::string> out;
  DIR* d = opendir(dir.c_str());
  if (!d) return out;
  while (const dirent* entry = readdir(d)) {
    const std::string name = entry->d_name;
    if (name.find("tfevents") != std::string::npos) out.push_back(dir + "/" + name);
  }
  closedir(d);
  return out;
}

std::string file_name(const std::string& path) { return path.substr(path.find_last_of('/') + 1); }

// ---------------------------------------------------------------------------------------
// CRC-32C and framing

TEST(Crc32c, MatchesPublishedVectors) {
  // "123456789" is the standard check value; the 32-byte vectors are RFC 3720, B.4.
  EXPECT_EQ(crc32c("123456789", 9), 0xE3069283u);
  std::string zeros(32, '\0'), ones(32, '\xff'), up(32, '\0'), down(32, '\0');
  for (int i = 0; i < 32; ++i) {
    up[i] = static_cast<char>(i);
    down[i] = static_cast<char>(31 - i);
  }
  EXPECT_EQ(crc32c(zeros.data(), zeros.size()), 0x8A9136AAu);
  EXPECT_EQ(crc32c(ones.data(), ones.size()), 0x62A8AB43u);
  EXPECT_EQ(crc32c(up.data(), up.size()), 0x46DD794Eu);
  EXPECT_EQ(crc32c(down.data(), down.size()), 0x113FDB5Cu);
  EXPECT_EQ(crc32c(nullptr, 0), 0u);
  EXPECT_EQ(crc32c_portable("123456789", 9), 0xE3069283u);
  EXPECT_EQ(crc32c_portable(up.data(), up.size()), 0x46DD794Eu);
}

TEST(Crc32c, HardwareAndTableAgreeAndExtend) {
  std::mt19937 rng(7);
  std::string data(4096 + 13, '\0');
  for (auto& c : data) c = static_cast<char>(rng());
  for (size_t offset : {0, 1, 3, 7}) {
    for (size_t size : {0, 1, 7, 8, 9, 63, 64, 65, 1000, 4096}) {
      const char* p = data.data() + offset;
      ASSERT_EQ(crc32c(p, size), crc32c_portable(p, size)) << offset << " " << size;
      for (size_t split : {size_t{0}, size / 3, size}) {
        EXPECT_EQ(crc32c(p + split, size - split, crc32c(p, split)), crc32c(p, size));
        EXPECT_EQ(crc32c_portable(p + split, size - split, crc32c_portable(p, split)),
                  crc32c(p, size));
      }
    }
  }
}

TEST(Crc32c, MaskIsTfRecords) {
  // ((crc >> 15) | (crc << 17)) + 0xa282ead8, computed here by hand for two values.
  EXPECT_EQ(mask_crc32c(0), 0xa282ead8u);
  const uint32_t c = 0xE3069283u;
  const uint32_t rotated = (c >> 15) | (c << 17);
  EXPECT_EQ(mask_crc32c(c), static_cast<uint32_t>(rotated + 0xa282ead8u));
}

TEST(TfRecord, FrameLayout) {
  const std::string data = "hello tensorboard";
  const std::string rec = tfrecord_frame(data);
  ASSERT_EQ(rec.size(), 8 + 4 + data.size() + 4);
  uint64_t length = 0;
  for (int i = 7; i >= 0; --i) length = (length << 8) | static_cast<unsigned char>(rec[i]);
  EXPECT_EQ(length, data.size());
  auto le32 = [&](size_t at) {
    uint32_t v = 0;
    for (int i = 3; i >= 0; --i) v = (v << 8) | static_cast<unsigned char>(rec[at + i]);
    return v;
  };
  EXPECT_EQ(le32(8), mask_crc32c(crc32c(rec.data(), 8)));
  EXPECT_EQ(rec.substr(12, data.size()), data);
  EXPECT_EQ(le32(12 + data.size()), mask_crc32c(crc32c(data.data(), data.size())));
}

// ---------------------------------------------------------------------------------------
// Event files read by TensorBoard

// The run's scalars as closed forms of the step.
double loss_at(int s) { return 2.0 * std::exp(-0.1 * s) + 0.05 * (s % 3); }
double lr_at(int s) { return 1e-3 * std::min(1.0, s / 5.0); }
double scale_at(int s) { return 65536.0 / std::pow(2.0, s / 7); }
double norm_at(int s) { return 1.0 + 0.5 * std::sin(s); }
double eval_at(int s) { return 2.5 * std::exp(-0.08 * s); }

TEST(TensorBoard, TwentyStepRunReadsBackInTensorBoard) {
  ScratchDir dir("tb_run", /*create=*/false);
  const double t0 = 1.7e9;  // a fixed wall clock: seconds since the epoch
  std::string file;
  {
    EventWriter writer(dir.str(), /*enabled=*/true);
    file = writer.path();
    writer.add_text("config", 0, "batch_size: 16\n\nlr: 0.001", t0);
    for (int s = 1; s <= 20; ++s) {
      StepMetrics m;
      m.step = s;
      m.loss = loss_at(s);
      m.lr = lr_at(s);
      m.loss_scale = scale_at(s);
      m.grad_norm = norm_at(s);
      m.step_ms = 100.0 + s;
      m.samples_per_s = 1000.0 + 10.0 * s;
      m.mem_allocated_mb = 100.0 + s;
      m.mem_peak_mb = 200.0 + 2 * s;
      if (s % 5 == 0) m.eval_loss = eval_at(s);
      m.extra["buckets"] = 3;
      writer.add_metrics(m, t0 + s);
    }
    writer.add_scalar("custom/last", 20, -1.25, t0 + 21);  // flushed by the destructor
  }
  EXPECT_EQ(file_name(file).rfind("events.out.tfevents.", 0), 0u) << file;

  const json out =
      json::parse(testing_util::run_python("tests/reference/read_tensorboard.py", {dir.str()}));
  ASSERT_EQ(out["files"].size(), 1u);
  EXPECT_EQ(out["files"][0]["file_version"], "brain.Event:2");
  // 1 version + 1 text + 20 steps x 9 scalars + 4 eval + 1 custom.
  EXPECT_EQ(out["files"][0]["records"], 1 + 1 + 20 * 9 + 4 + 1);

  const json& sc = out["scalars"];
  struct Expected {
    const char* tag;
    std::function<double(int)> f;
    int every;
  };
  const std::vector<Expected> expected = {
      {"train/loss", loss_at, 1},
      {"train/lr", lr_at, 1},
      {"train/loss_scale", scale_at, 1},
      {"train/grad_norm", norm_at, 1},
      {"perf/step_ms", [](int s) { return 100.0 + s; }, 1},
      {"perf/samples_per_s", [](int s) { return 1000.0 + 10.0 * s; }, 1},
      {"memory/allocated_mb", [](int s) { return 100.0 + s; }, 1},
      {"memory/peak_mb", [](int s) { return 200.0 + 2.0 * s; }, 1},
      {"extra/buckets", [](int) { return 3.0; }, 1},
      {"eval/loss", eval_at, 5},
  };
  EXPECT_EQ(sc.size(), expected.size() + 1);
  for (const auto& e : expected) {
    SCOPED_TRACE(e.tag);
    ASSERT_TRUE(sc.contains(e.tag));
    const json& points = sc[e.tag];
    ASSERT_EQ(points.size(), static_cast<size_t>(20 / e.every));
    for (size_t i = 0; i < points.size(); ++i) {
      const int step = static_cast<int>((i + 1) * e.every);
      EXPECT_EQ(points[i][0].get<int>(), step);
      // simple_value is float32: equal to the float rounding of the closed form.
      EXPECT_EQ(points[i][1].get<double>(), static_cast<double>(static_cast<float>(e.f(step))));
      EXPECT_EQ(points[i][2].get<double>(), t0 + step);
    }
  }
  ASSERT_TRUE(sc.contains("custom/last"));
  EXPECT_EQ(sc["custom/last"][0][0], 20);
  EXPECT_EQ(sc["custom/last"][0][1].get<double>(), -1.25);
  ASSERT_TRUE(out["texts"].contains("config"));
  EXPECT_EQ(out["texts"]["config"][0][1], "batch_size: 16\n\nlr: 0.001");
}

TEST(TensorBoard, WritersOfOneProcessGetTheirOwnFiles) {
  ScratchDir dir("tb_two", /*create=*/false);
  EventWriter a(dir.str(), true), b(dir.str(), true);
  EXPECT_NE(a.path(), b.path());
  EXPECT_EQ(events_files(dir.str()).size(), 2u);
}

TEST(TensorBoard, DisabledWriterTouchesNothing) {
  ScratchDir dir("tb_off", /*create=*/false);
  EventWriter w(dir.str(), /*enabled=*/false);
  w.add_scalar("x", 1, 1.0);
  w.flush();
  EXPECT_FALSE(w.enabled());
  EXPECT_EQ(w.path(), "");
  EXPECT_FALSE(event_dir_exists(dir.str()));
}

TEST(TensorBoard, CreatesMissingDirectoriesAndWritesTheVersionRecordAtOnce) {
  ScratchDir dir("tb_nested", /*create=*/false);
  EventWriter w(dir / "a/b", true);
  const auto files = events_files(dir / "a/b");
  ASSERT_EQ(files.size(), 1u);
  // Already on disk before any scalar: one framed record holding "brain.Event:2".
  std::ifstream in(files[0], std::ios::binary);
  const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  ASSERT_GT(bytes.size(), 16u);
  EXPECT_NE(bytes.find("brain.Event:2"), std::string::npos);
}

TEST(TensorBoard, UnwritableDirectoryIsReportedAtConstruction) {
  ScratchDir dir("tb_bad", /*create=*/false);
  ASSERT_EQ(mkdir(dir.str().c_str(), 0700), 0);
  const std::string blocker = dir / "file";
  std::ofstream(blocker) << "a file, not a directory";
  // A directory below a regular file cannot be created.
  const std::string below = blocker + "/logs";
  std::string what = error_of([&] { EventWriter w(below, true); });
  EXPECT_NE(what.find(below), std::string::npos) << what;
  EXPECT_NE(what.find("--tensorboard_dir"), std::string::npos) << what;
  // The path names a regular file.
  what = error_of([&] { EventWriter w(blocker, true); });
  EXPECT_NE(what.find(blocker), std::string::npos) << what;
  // An existing directory nobody may create files in (even root): /proc/self.
  what = error_of([&] { EventWriter w("/proc/self", true); });
  EXPECT_NE(what.find("/proc/self"), std::string::npos) << what;
  what = error_of([&] { EventWriter w("", true); });
  EXPECT_NE(what.find("--tensorboard_dir"), std::string::npos) << what;
}

}  // namespace
}  // namespace dtrain::engine
