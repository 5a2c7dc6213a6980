// Private to the checkpoint sources (and their tests): the file format and file names.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "dtrain/engine/state/checkpoint.h"

namespace dtrain::engine::ckpt_detail {


// Format tag and version stored in every .pt file and every record.
inline constexpr const char* kFormat = "dtrain.checkpoint";
inline constexpr int64_t kVersion = 1;

// Streams data as a torch.save zip archive to sink (called with consecutive chunks). Tensors
// are written as CPU tensors; the archive holds a plain dict (no TorchScript type tags), so
// torch.load(weights_only=True) reads it.
void write_main_archive(const CheckpointData& data,
                        const std::function<void(const char*, size_t)>& sink);
void write_rank_archive(int64_t step, const RankState& state,
                        const std::function<void(const char*, size_t)>& sink);
// Parse a whole archive; throw dtrain::Error naming source when it is not a dtrain
// checkpoint of the expected kind.
CheckpointData read_main_archive(const std::vector<char>& bytes, const std::string& source);
RankState read_rank_archive(const std::vector<char>& bytes, const std::string& source,
                            int64_t* step);

// The commit record next to each file: "<kFormat> <kVersion> crc32c=<8 hex> bytes=<n>
// rank_files=<N>\n".
struct Record {
  uint32_t crc = 0;
  uint64_t bytes = 0;
  int rank_files = 0;
};
std::string format_record(const Record& record);
// nullopt when text is not a record of this version.
std::optional<Record> parse_record(const std::string& text);

// What a name in a checkpoint directory is.
struct FileName {
  enum Kind { kMain, kMainRecord, kRank, kRankRecord, kTemp } kind;
  int64_t step = 0;
  int rank = -1;  // for kRank, kRankRecord
};
// nullopt for names that are not the store's.
std::optional<FileName> parse_file_name(const std::string& name);

}  // namespace dtrain::engine::ckpt_detail
