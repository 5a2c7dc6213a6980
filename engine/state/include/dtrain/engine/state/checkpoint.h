// Checkpoints: a directory of self-checking files that a crash mid-save cannot spoil.
//
// Layout (docs/CLUSTER.md has the full story):
//   DIR/step-000120.pt             main file (rank 0): model, replicated optimizer state, loss
//                                  scaler, rank 0's RNG state, metadata
//   DIR/step-000120.pt.crc         its commit record: "dtrain-checkpoint 1 crc32c=<hex>
//                                  bytes=<n> rank_files=<N>"
//   DIR/step-000120.rank-R.pt      rank R's own state (partitioned optimizer shard, RNG), R < N
//   DIR/step-000120.rank-R.pt.crc  its record
// Every file is written to a temporary name in DIR, synced, renamed, and DIR synced; the
// main file's record is renamed last, so a checkpoint exists exactly when that record does.
// A crash at any point leaves the previous checkpoint as the newest one with a record.
//
// Every .pt file is a zip archive in torch.save's format, readable in Python with
// torch.load(path, weights_only=True): a dict whose "model" entry is a state dict under the
// names the equivalent torch.nn.Module uses (module.load_state_dict(ckpt["model"])).
// Tensors are saved and loaded as CPU tensors; dtypes are kept.
//
// Failures: I/O errors throw dtrain::Error naming the file and the system's reason. A
// missing checkpoint is not an error (latest_good() returns nullopt). A corrupt, truncated or
// incomplete checkpoint is skipped by latest_good() with a warning naming the file and why,
// and refused by load() with a dtrain::Error saying the same.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "dtrain/engine/core/shard.h"

namespace torch::nn {
class Module;
}
namespace dtrain::dist {
class Communicator;
}

namespace dtrain::engine {

// ---- file system ------------------------------------------------------------------------------
// The store reaches files only through this interface (LevelDB's Env), so tests can inject
// faults. Every method throws dtrain::Error naming the path and the reason on failure.
// Implementations must be safe to use from several threads on different paths.

class WritableFile {
 public:
  virtual ~WritableFile() = default;  // closes without syncing if close() was not called
  virtual void append(const char* data, size_t n) = 0;
  virtual void sync() = 0;   // data on stable storage (fsync)
  virtual void close() = 0;  // once; append/sync are invalid afterwards
};

class ReadableFile {
 public:
  virtual ~ReadableFile() = default;
  // Reads up to n bytes at the current position; returns 0 at end of file.
  virtual size_t read(char* buffer, size_t n) = 0;
};

class FileSystem {
 public:
  virtual ~FileSystem() = default;
  // Creates or truncates path.
  virtual std::unique_ptr<WritableFile> new_writable_file(const std::string& path) = 0;
  virtual std::unique_ptr<ReadableFile> new_readable_file(const std::string& path) = 0;
  virtual bool exists(const std::string& path) = 0;
  virtual uint64_t file_size(const std::string& path) = 0;
  // Names (not paths) of the entries of dir, in no particular order.
  virtual std::vector<std::string> list_dir(const std::string& dir) = 0;
  virtual void create_dirs(const std::string& dir) = 0;  // mkdir -p
  // Atomically replaces to by from (same directory).
  virtual void rename(const std::string& from, const std::string& to) = 0;
  virtual void remove(const std::string& path) = 0;
  // Makes renames and creations in dir durable (fsync of the directory).
  virtual void sync_dir(const std::string& dir) = 0;
};

// The POSIX file system (process-wide, never destroyed).
FileSystem* default_file_system();

// ---- what a checkpoint holds --------------------------------------------------------------------

// Random generator states of this process.
struct RngState {
  at::Tensor cpu;                // the default CPU generator (uint8); undefined: not saved
  std::vector<at::Tensor> cuda;  // the default generator of each CUDA device, by index
};
// Copies the states of the default generators (CUDA ones only when CUDA is available).
RngState capture_rng_state();
// Sets them; CUDA states beyond the devices present are ignored. Throws dtrain::Error for a
// state the generator rejects (e.g. a CPU state of the wrong size).
void restore_rng_state(const RngState& state);

// The main file. On load, every tensor is a CPU tensor.
struct CheckpointData {
  int64_t step = 0;        // optimizer steps taken (the run resumes at step + 1)
  NamedTensors model;      // model_state(module): names as in PyTorch's state_dict
  NamedTensors optimizer;  // Optimizer::state() of a replicated optimizer; empty if partitioned
  NamedTensors scaler;     // LossScaler::state(); empty when the scaler is disabled
  NamedTensors masks;      // pruning masks (bool, unsplit) by parameter name; empty: none
  RngState rng;            // of the saving process (rank 0)
  // Free-form strings, e.g. "schedule" (its options), "loader.train" = "epoch,index" (the
  // DataLoader::position() to seek() to) with "loader.train.batch" / ".seed" / ".samples" (its
  // global batch, order seed and dataset size, for a resume with another batch), "program",
  // "args", "shape.<flag>" (what built the model: compared on every restore).
  std::map<std::string, std::string> meta;
  int world_size = 1;
  int dp_size = 1;     // world_size / (dp_size x pipeline_stages()) is the tensor-parallel size
  int rank_files = 0;  // rank files 0..rank_files-1 belong to this checkpoint
  // The pipeline stages of the run that saved it (meta "pp"; 1 when absent).
  int pipeline_stages() const { return meta.count("pp") ? std::stoi(meta.at("pp")) : 1; }
  // With several stages: the elements of each stage's partitioned flat optimizer space on
  // tensor-parallel rank tp_rank, stage after stage (meta "pp.flat_numel": stages x tp counts,
  // stage-major); empty without stages or when the checkpoint did not record them. Throws
  // dtrain::Error for a malformed record or a tp_rank it does not have.
  std::vector<int64_t> stage_flat_numels(int tp_rank) const;
};

// One rank's own part of a checkpoint.
struct RankState {
  int rank = 0;     // world rank; the file is step-N.rank-<rank>.pt
  int dp_rank = 0;  // position in its data-parallel group
  int dp_size = 1;
  int tp_rank = 0;  // world rank = dp_rank * (world_size / dp_size) + tp_rank
  // Partitioned optimizer state of this data-parallel rank (Optimizer::shard_state(): its
  // range of the flat space and the tensors of that range); layout.numel 0: none.
  ShardState optimizer_shard;
  // Pipeline parallelism (main meta "pp" > 1): the file of each stage's data- and
  // tensor-parallel rank 0 after stage 0 holds that stage's part of the model (its parameters
  // under the whole model's names) and of the replicated optimizer state (under the whole
  // model's parameter indices); stage 0's part is the main file's. Empty otherwise.
  NamedTensors stage_model;
  NamedTensors stage_optimizer;
  RngState rng;
  std::map<std::string, std::string> meta;
};

// ---- the store ----------------------------------------------------------------------------------

struct CheckpointStoreOptions {
  // After each save(), remove all but the newest keep_last checkpoints (0: keep every one).
  int keep_last = 0;
  // Where files go; nullptr: default_file_system(). Not owned; must outlive the store.
  FileSystem* fs = nullptr;
};

struct CheckpointInfo {
  int64_t step = 0;
  std::string path;    // of the main file
  int rank_files = 0;  // from the commit record
};

// Saves and finds checkpoints in one directory. Not thread-safe; one writer per directory
// (rank 0 for main files, each rank for its own rank files).
class CheckpointStore {
 public:
  // Throws dtrain::Error for an empty dir or keep_last < 0. The directory is created by the
  // first save.
  explicit CheckpointStore(std::string dir, CheckpointStoreOptions options = {});

  // Writes and commits the main file of data.step (replacing one of the same step) and
  // returns its path; then prunes to keep_last and removes temporary files that crashed
  // saves of earlier steps left. Rank files 0..data.rank_files-1 of that step must be
  // written first (their records are checked). Synchronous: durable when it returns. On
  // failure throws dtrain::Error and the previous checkpoints are untouched.
  std::string save(const CheckpointData& data);
  // Writes this rank's file for `step` (durable when it returns); returns its path. It
  // becomes part of a checkpoint only when the main file of that step is saved.
  std::string save_rank(int64_t step, const RankState& state);

  // Committed checkpoints (those with a main record), newest first, not verified.
  std::vector<CheckpointInfo> list() const;
  // Main files without a record (a save that did not finish, or checkpoints copied without
  // their .crc records), newest first: what list() leaves out.
  std::vector<std::string> unrecorded() const;
  // The newest checkpoint whose main file and rank files exist with the size and CRC-32C
  // their records give. Each one skipped is logged (LOG(WARNING)) and, when skipped is given,
  // appended to it as "<file>: <why>". nullopt when there is none. Reads every byte checked.
  std::optional<CheckpointInfo> latest_good(std::vector<std::string>* skipped = nullptr) const;
  // Reads a main file, checking it against its record first. Throws dtrain::Error naming the
  // file and the problem (missing, no record, truncated, checksum mismatch, not a dtrain
  // checkpoint). A pipeline-parallel checkpoint (meta "pp" = P > 1) is whole again: the other
  // stages' parts (RankState::stage_model, stage_optimizer) are read from their rank files and
  // appended in stage order. Memory: the file's bytes plus the tensors made from them, at the peak.
  CheckpointData load(const std::string& path) const;
  RankState load_rank(int64_t step, int rank) const;

  // What a failed collective save leaves behind: removes rank `rank`'s file of `step` and its
  // record, unless a main file of that step is committed (then they belong to it). Never
  // throws; logs what it cannot remove (the next run's clean-up skips such files anyway: a
  // rank file without a committed main file is never read).
  void discard_uncommitted_rank_file(int64_t step, int rank) const;

  // Removes every checkpoint file of the directory (committed or not, records first; other
  // files stay) and returns how many committed checkpoints it held. For a run told to start
  // over in a directory of an earlier run's checkpoints. Throws dtrain::Error when a file
  // cannot be removed (the checkpoints whose records went first are gone then).
  int remove_all();
  // Renames every checkpoint file of a step after `step` to NAME.bad (records first) and returns
  // how many steps it set aside. For a resume from `step`, which latest_good() chose over them:
  // they are bad (truncated, corrupt, unrecorded), kept for inspection, and no longer count for
  // keep_last (which would otherwise keep them and delete good older ones).
  int set_aside_newer_than(int64_t step);

  std::string path_for(int64_t step) const;                 // DIR/step-000123.pt
  std::string rank_path_for(int64_t step, int rank) const;  // DIR/step-000123.rank-R.pt
  const std::string& dir() const { return dir_; }

 private:
  void prune_and_clean(int64_t committed_step);

  std::string dir_;
  CheckpointStoreOptions options_;
  FileSystem* fs_;
};

// ---- model state ------------------------------------------------------------------------------

// The module's parameters and buffers in PyTorch's state_dict order and names: for each
// module in pre-order, its own parameters then its own buffers ("encoder.0.weight", ...).
// The tensors alias the module's (detached).
NamedTensors model_state(const torch::nn::Module& module);
// Copies state into the module's parameters and buffers (dtype converted, under no-grad).
// First checks that the names and shapes are exactly the module's, and throws dtrain::Error
// naming `source` and the first difference (missing name, unexpected name, other shape)
// without changing anything.
void load_model_state(torch::nn::Module& module, const NamedTensors& state,
                      const std::string& source);
// The same check for any named state (e.g. Optimizer::state()): `saved` must hold exactly
// `live`'s names with its shapes. `what` names the state in the message ("model").
void check_same_layout(const NamedTensors& live, const NamedTensors& saved, const std::string& what,
                       const std::string& source);

// ---- partitioned (flat) state -------------------------------------------------------------------
// Where a pipeline stage's flat space lies in the whole model's: the stages' spaces (each its
// parameters end to end, in the model's order) laid end to end in stage order, per
// tensor-parallel rank. The default is no pipeline: the stage is the whole.
struct StageSpace {
  int stage = 0;
  int stages = 1;
  int64_t offset = 0;        // elements of the stages before this one
  int64_t whole_numel = -1;  // elements of every stage together (-1: the target's numel)
};

// Layout and assembly: shard.h. Reads from `store` only the rank files of checkpoint `main`
// (already loaded) of tensor-parallel rank tp_rank whose ranges (main.dp_size ranks in the
// layout of shard.h: one range each, or one piece of every unit under the unit bounds the
// files record) overlap target.ranges, and assembles target's state from them
// (assemble_shard); any old data-parallel size and unit layout resumes any new one (a per-unit
// checkpoint may cost one rank file read in vain, to learn its units). Pipeline stages: the
// target's ranges are placed in the whole model's flat space (`space`), the old stages' ranges
// likewise (CheckpointData::stage_flat_numels), so any old split into stages (or none)
// resumes any new one; a checkpoint saved without the stages' sizes resumes under its own
// --pp only (dtrain::Error naming it). Throws dtrain::Error for a tensor-parallel rank the
// checkpoint does not have, a checkpoint without rank files, a rank file of another position
// or model, a whole model of another size, or what assemble_shard throws.
ShardState load_resharded_optimizer(const CheckpointStore& store, const CheckpointData& main,
                                    int tp_rank, const ShardLayout& target, const StageSpace& space = {});

// ---- collective save and resume ---------------------------------------------------------------

// Collective over world: every rank writes its rank file; once all succeeded, rank 0 writes
// the main file (data, with rank_files = world.size(); other ranks' data is ignored except
// step, which must match). data.world_size must be world.size() and rank_state.rank
// world.rank() (checked before anything is written). Returns the main file's path on every rank, or
// throws dtrain::Error on every rank when any rank failed (naming the ranks), in which case no new
// checkpoint is committed.
std::string save_checkpoint(CheckpointStore& store, dist::Communicator& world,
                            const CheckpointData& data, const RankState& rank_state);
// Collective over world: rank 0 finds latest_good() and every rank gets the same answer; with
// `skipped`, how many checkpoints it skipped as not good (every rank gets the count).
std::optional<CheckpointInfo> agree_latest_good(const CheckpointStore& store,
                                                dist::Communicator& world, int64_t* skipped = nullptr);

}  // namespace dtrain::engine

#include "dtrain/dist/glog_compat.h"  // last: keeps glog's LOG macros whatever the include order
