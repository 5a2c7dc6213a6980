// CheckpointStore: atomic writes with commit records, verification, pruning.
#include <glog/logging.h>
#include <unistd.h>

#include <algorithm>
#include <cinttypes>
#include <cstdio>
#include <functional>
#include <set>

#include "checkpoint_internal.h"
#include "dtrain/dist/error.h"
#include "dtrain/engine/core/crc32c.h"
#include "dtrain/engine/state/checkpoint.h"

namespace dtrain::engine {
namespace {

using ckpt_detail::FileName;
using ckpt_detail::Record;
using Sink = std::function<void(const char*, size_t)>;

constexpr size_t kReadChunk = 4 << 20;
constexpr size_t kMaxRecordBytes = 4096;
constexpr const char* kRecordSuffix = ".crc";

std::string join(const std::string& dir, const std::string& name) { return dir + "/" + name; }

std::string base_name(const std::string& path) {
  size_t slash = path.rfind('/');
  return slash == std::string::npos ? path : path.substr(slash + 1);
}

std::string temp_suffix() { return ".tmp." + std::to_string(::getpid()); }

std::string hex32(uint32_t value) {
  char text[16];
  std::snprintf(text, sizeof(text), "%08" PRIx32, value);
  return text;
}

// Writes path through a temporary name, then its record (through one too), syncing the file,
// the record and the directory so that the record never names bytes that are not on disk.
// On failure removes what it can of the temporaries and rethrows.
void write_with_record(FileSystem* fs, const std::string& dir, const std::string& path,
                       int rank_files, const std::function<void(const Sink&)>& produce) {
  const std::string tmp = path + temp_suffix();
  const std::string record_path = path + kRecordSuffix;
  const std::string record_tmp = record_path + temp_suffix();
  try {
    Record record;
    record.rank_files = rank_files;
    {
      std::unique_ptr<WritableFile> file = fs->new_writable_file(tmp);
      produce([&](const char* p, size_t n) {
        file->append(p, n);
        record.crc = crc32c(p, n, record.crc);
        record.bytes += n;
      });
      file->sync();
      file->close();
    }
    fs->rename(tmp, path);
    {
      const std::string text = ckpt_detail::format_record(record);
      std::unique_ptr<WritableFile> file = fs->new_writable_file(record_tmp);
      file->append(text.data(), text.size());
      file->sync();
      file->close();
    }
    fs->sync_dir(dir);  // the data file's new name is durable before the record names it
    fs->rename(record_tmp, record_path);
    fs->sync_dir(dir);
  } catch (const std::exception& e) {
    for (const std::string& t : {tmp, record_tmp}) {
      try {
        if (fs->exists(t)) fs->remove(t);
      } catch (const std::exception&) {
        // Left for the next save's clean-up.
      }
    }
    throw Error(detail::concat("cannot save checkpoint file ", path, ": ", e.what()));
  }
}

std::string read_small_file(FileSystem* fs, const std::string& path) {
  std::unique_ptr<ReadableFile> file = fs->new_readable_file(path);
  std::string text(kMaxRecordBytes, '\0');
  size_t got = 0;
  while (got < text.size()) {
    size_t n = file->read(text.data() + got, text.size() - got);
    if (n == 0) break;
    got += n;
  }
  text.resize(got);
  return text;
}

// Checks path against its record, reading every byte (into *bytes when given). Returns
// empty when good, else why not (also for I/O errors).
std::string check_file(FileSystem* fs, const std::string& path, std::vector<char>* bytes,
                       Record* record_out) {
  const std::string record_path = path + kRecordSuffix;
  try {
    if (!fs->exists(record_path)) {
      return fs->exists(path)
                 ? "no checksum record " + base_name(record_path) + " (the save did not finish)"
                 : "the file does not exist";
    }
    const std::string text = read_small_file(fs, record_path);
    std::optional<Record> record = ckpt_detail::parse_record(text);
    if (!record) return "its checksum record " + base_name(record_path) + " is malformed";
    if (record_out) *record_out = *record;
    if (!fs->exists(path)) return "the file is missing although its record exists";
    const uint64_t size = fs->file_size(path);
    if (size < record->bytes) {
      return "truncated: " + std::to_string(size) + " bytes on disk, " +
             std::to_string(record->bytes) + " recorded";
    }
    if (size > record->bytes) {
      return "size changed: " + std::to_string(size) + " bytes on disk, " +
             std::to_string(record->bytes) + " recorded";
    }
    std::unique_ptr<ReadableFile> file = fs->new_readable_file(path);
    std::vector<char> chunk(bytes ? 0 : std::min<uint64_t>(kReadChunk, size));
    if (bytes) bytes->resize(size);
    uint64_t done = 0;
    uint32_t crc = 0;
    while (done < size) {
      char* at = bytes ? bytes->data() + done : chunk.data();
      size_t want = static_cast<size_t>(std::min<uint64_t>(kReadChunk, size - done));
      size_t n = file->read(at, want);
      if (n == 0) break;
      crc = crc32c(at, n, crc);
      done += n;
    }
    if (done != size) {
      return "truncated while reading: " + std::to_string(done) + " of " + std::to_string(size) +
             " bytes";
    }
    if (crc != record->crc) {
      return "checksum mismatch: crc32c " + hex32(crc) + " on disk, " + hex32(record->crc) +
             " recorded (the file is corrupt)";
    }
    return "";
  } catch (const std::exception& e) {
    return std::string("cannot be read: ") + e.what();
  }
}

}  // namespace

CheckpointStore::CheckpointStore(std::string dir, CheckpointStoreOptions options)
    : dir_(std::move(dir)), options_(options) {
  while (dir_.size() > 1 && dir_.back() == '/') dir_.pop_back();
  DTRAIN_CHECK(!dir_.empty(), "no checkpoint directory was given (the path is empty); pass --save_dir=DIR");
  DTRAIN_CHECK(options_.keep_last >= 0, "keep_last=", options_.keep_last,
               " must be >= 0 (0 keeps every checkpoint)");
  fs_ = options_.fs ? options_.fs : default_file_system();
}

std::string CheckpointStore::path_for(int64_t step) const {
  char name[48];
  std::snprintf(name, sizeof(name), "step-%06" PRId64 ".pt", step);
  return join(dir_, name);
}

std::string CheckpointStore::rank_path_for(int64_t step, int rank) const {
  char name[64];
  std::snprintf(name, sizeof(name), "step-%06" PRId64 ".rank-%d.pt", step, rank);
  return join(dir_, name);
}

std::string CheckpointStore::save(const CheckpointData& data) {
  DTRAIN_CHECK(data.step >= 0, "checkpoint step ", data.step, " must be >= 0");
  DTRAIN_CHECK(data.world_size >= 1 && data.dp_size >= 1 && data.world_size % data.dp_size == 0,
               "checkpoint world_size ", data.world_size, " and dp_size ", data.dp_size,
               " are not a valid mesh (dp_size must divide world_size)");
  DTRAIN_CHECK(data.rank_files >= 0, "checkpoint rank_files ", data.rank_files, " must be >= 0");
  fs_->create_dirs(dir_);
  for (int r = 0; r < data.rank_files; ++r) {
    const std::string record = rank_path_for(data.step, r) + kRecordSuffix;
    DTRAIN_CHECK(fs_->exists(record), "cannot commit checkpoint step ", data.step, ": rank file ",
                 rank_path_for(data.step, r), " has no record; every rank must save_rank() ",
                 "before the main file is saved (save_checkpoint() does this)");
  }
  const std::string path = path_for(data.step);
  write_with_record(fs_, dir_, path, data.rank_files,
                    [&](const Sink& sink) { ckpt_detail::write_main_archive(data, sink); });
  try {
    prune_and_clean(data.step);
  } catch (const std::exception& e) {
    LOG(WARNING) << "checkpoint " << path << " saved, but cleaning up " << dir_
                 << " failed: " << e.what();
  }
  return path;
}

void CheckpointStore::discard_uncommitted_rank_file(int64_t step, int rank) const {
  try {
    if (fs_->exists(path_for(step) + kRecordSuffix)) return;  // committed: the files are its
    for (const std::string& path : {rank_path_for(step, rank) + kRecordSuffix, rank_path_for(step, rank)}) {
      if (fs_->exists(path)) fs_->remove(path);
    }
  } catch (const std::exception& e) {
    LOG(WARNING) << "could not remove the rank file of the failed save of step " << step << ": " << e.what();
  }
}

std::string CheckpointStore::save_rank(int64_t step, const RankState& state) {
  DTRAIN_CHECK(step >= 0, "checkpoint step ", step, " must be >= 0");
  DTRAIN_CHECK(state.rank >= 0, "rank ", state.rank, " must be >= 0");
  DTRAIN_CHECK(state.dp_size >= 1 && state.dp_rank >= 0 && state.dp_rank < state.dp_size,
               "dp_rank ", state.dp_rank, " is not in [0, dp_size=", state.dp_size, ")");
  const ShardLayout& shard = state.optimizer_shard.layout;
  DTRAIN_CHECK(shard.numel >= 0, "optimizer shard of a flat space of ", shard.numel, " elements: must be >= 0");
  int64_t end = 0;  // ascending and disjoint
  for (const FlatRange& r : shard.ranges) {
    DTRAIN_CHECK(0 <= r.begin && r.begin <= r.end && r.end <= shard.numel, "optimizer shard [", r.begin, ", ",
                 r.end, ") of a flat space of ", shard.numel, " elements is not a range of it");
    DTRAIN_CHECK(end <= r.begin, "optimizer shard range [", r.begin, ", ", r.end, ") follows one ending at ", end,
                 "; a rank's ranges must be ascending and disjoint");
    end = r.end;
  }
  if (!shard.unit_bounds.empty()) shard_ranges(shard.numel, 1, 0, shard.unit_bounds);  // throws for bad bounds
  fs_->create_dirs(dir_);
  const std::string path = rank_path_for(step, state.rank);
  write_with_record(fs_, dir_, path, 0,
                    [&](const Sink& sink) { ckpt_detail::write_rank_archive(step, state, sink); });
  return path;
}

std::vector<CheckpointInfo> CheckpointStore::list() const {
  std::vector<CheckpointInfo> found;
  if (!fs_->exists(dir_)) return found;
  for (const std::string& name : fs_->list_dir(dir_)) {
    std::optional<FileName> file = ckpt_detail::parse_file_name(name);
    if (!file || file->kind != FileName::kMainRecord) continue;
    std::optional<Record> record;
    try {
      record = ckpt_detail::parse_record(read_small_file(fs_, join(dir_, name)));
    } catch (const std::exception&) {
    }
    if (!record) continue;
    found.push_back({file->step, path_for(file->step), record->rank_files});
  }
  std::sort(found.begin(), found.end(),
            [](const CheckpointInfo& a, const CheckpointInfo& b) { return a.step > b.step; });
  return found;
}

std::vector<std::string> CheckpointStore::unrecorded() const {
  std::vector<std::string> out;
  if (!fs_->exists(dir_)) return out;
  std::set<int64_t, std::greater<int64_t>> steps;
  for (const std::string& name : fs_->list_dir(dir_)) {
    std::optional<FileName> file = ckpt_detail::parse_file_name(name);
    if (file && file->kind == FileName::kMain && !fs_->exists(join(dir_, name) + kRecordSuffix)) steps.insert(file->step);
  }
  for (int64_t step : steps) out.push_back(path_for(step));
  return out;
}

std::optional<CheckpointInfo> CheckpointStore::latest_good(
    std::vector<std::string>* skipped) const {
  if (!fs_->exists(dir_)) return std::nullopt;
  std::set<int64_t, std::greater<int64_t>> steps;
  for (const std::string& name : fs_->list_dir(dir_)) {
    std::optional<FileName> file = ckpt_detail::parse_file_name(name);
    if (file && (file->kind == FileName::kMain || file->kind == FileName::kMainRecord)) {
      steps.insert(file->step);
    }
  }
  for (int64_t step : steps) {
    const std::string path = path_for(step);
    Record record;
    std::string bad_file = path;
    std::string why = check_file(fs_, path, nullptr, &record);
    for (int r = 0; why.empty() && r < record.rank_files; ++r) {
      bad_file = rank_path_for(step, r);
      why = check_file(fs_, bad_file, nullptr, nullptr);
    }
    if (why.empty()) return CheckpointInfo{step, path, record.rank_files};
    LOG(WARNING) << "skipping checkpoint step " << step << ": " << bad_file << ": " << why;
    if (skipped) skipped->push_back(bad_file + ": " + why);
  }
  return std::nullopt;
}

CheckpointData CheckpointStore::load(const std::string& path) const {
  std::vector<char> bytes;
  Record record;
  std::string why = check_file(fs_, path, &bytes, &record);
  DTRAIN_CHECK(why.empty(), "cannot load checkpoint ", path, ": ", why);
  CheckpointData data = ckpt_detail::read_main_archive(bytes, path);
  DTRAIN_CHECK(data.rank_files == record.rank_files, "checkpoint ", path, " names ",
               data.rank_files, " rank files but its record ", record.rank_files);
  const int stages = data.pipeline_stages();
  if (stages > 1) {
    // Stage s's part is in the rank file of its data- and tensor-parallel rank 0, world rank
    // s * (world / stages).
    DTRAIN_CHECK(data.world_size % stages == 0 && data.rank_files == data.world_size, "checkpoint ", path, " of ",
                 stages, " pipeline stages has ", data.rank_files, " rank files for a world of ", data.world_size);
    for (int s = 1; s < stages; ++s) {
      RankState part = load_rank(data.step, s * (data.world_size / stages));
      // (ZeRO-3's stages keep their weights in the partitioned state: a stage of weights only
      // has no other part.)
      DTRAIN_CHECK(!part.stage_model.empty() || data.meta.count("model.partitioned"), "checkpoint ",
                   rank_path_for(data.step, s * (data.world_size / stages)), " holds no part of the model, but it is ",
                   "pipeline stage ", s, "'s");
      for (auto& t : part.stage_model) data.model.push_back(std::move(t));
      for (auto& t : part.stage_optimizer) data.optimizer.push_back(std::move(t));
    }
  }
  return data;
}

RankState CheckpointStore::load_rank(int64_t step, int rank) const {
  const std::string path = rank_path_for(step, rank);
  std::vector<char> bytes;
  std::string why = check_file(fs_, path, &bytes, nullptr);
  DTRAIN_CHECK(why.empty(), "cannot load checkpoint rank file ", path, ": ", why);
  int64_t file_step = -1;
  RankState state = ckpt_detail::read_rank_archive(bytes, path, &file_step);
  DTRAIN_CHECK(file_step == step && state.rank == rank, "checkpoint rank file ", path,
               " holds step ", file_step, " of rank ", state.rank, "; it was renamed or copied");
  return state;
}

void CheckpointStore::prune_and_clean(int64_t committed_step) {
  const std::vector<std::string> names = fs_->list_dir(dir_);
  std::set<int64_t, std::greater<int64_t>> committed;
  for (const std::string& name : names) {
    std::optional<FileName> file = ckpt_detail::parse_file_name(name);
    if (file && file->kind == FileName::kMainRecord) committed.insert(file->step);
  }
  std::set<int64_t> keep = {committed_step};
  int kept = 0;
  for (int64_t step : committed) {
    if (options_.keep_last == 0 || kept < options_.keep_last) keep.insert(step);
    if (step <= committed_step) ++kept;
  }
  // Only files of earlier steps: a later step may belong to another run's checkpoints.
  std::vector<std::string> records;
  std::vector<std::string> others;
  for (const std::string& name : names) {
    std::optional<FileName> file = ckpt_detail::parse_file_name(name);
    if (!file || file->step >= committed_step) continue;
    if (file->kind != FileName::kTemp && keep.count(file->step)) continue;
    (file->kind == FileName::kMainRecord ? records : others).push_back(join(dir_, name));
  }
  // Records first: a crash mid-way leaves no committed checkpoint with missing files.
  for (const std::string& path : records) fs_->remove(path);
  for (const std::string& path : others) fs_->remove(path);
  if (!records.empty() || !others.empty()) fs_->sync_dir(dir_);
}

int CheckpointStore::set_aside_newer_than(int64_t step) {
  if (!fs_->exists(dir_)) return 0;
  std::vector<std::string> records, others;
  std::set<int64_t> steps;
  for (const std::string& name : fs_->list_dir(dir_)) {
    std::optional<FileName> file = ckpt_detail::parse_file_name(name);
    if (!file || file->kind == FileName::kTemp || file->step <= step) continue;
    steps.insert(file->step);
    (file->kind == FileName::kMainRecord ? records : others).push_back(join(dir_, name));
  }
  for (const std::string& path : records) fs_->rename(path, path + ".bad");
  for (const std::string& path : others) fs_->rename(path, path + ".bad");
  if (!steps.empty()) fs_->sync_dir(dir_);
  return static_cast<int>(steps.size());
}

int CheckpointStore::remove_all() {
  if (!fs_->exists(dir_)) return 0;
  std::vector<std::string> records, others;
  std::set<int64_t> steps;
  for (const std::string& name : fs_->list_dir(dir_)) {
    std::optional<FileName> file = ckpt_detail::parse_file_name(name);
    if (!file) continue;
    if (file->kind == FileName::kMainRecord) steps.insert(file->step);
    (file->kind == FileName::kMainRecord ? records : others).push_back(join(dir_, name));
  }
  // Records first: a crash mid-way leaves no committed checkpoint with missing files.
  for (const std::string& path : records) fs_->remove(path);
  for (const std::string& path : others) fs_->remove(path);
  if (!records.empty() || !others.empty()) fs_->sync_dir(dir_);
  return static_cast<int>(steps.size());
}

}  // namespace dtrain::engine
