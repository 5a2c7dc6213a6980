// The checkpoint file format: a torch.save zip archive holding one plain dict, and the
// commit records and file names of a checkpoint directory.
#include <ATen/ATen.h>
#include <ATen/core/Dict.h>
#include <ATen/core/List.h>
#include <ATen/core/ivalue.h>
#include <caffe2/serialize/inline_container.h>
#include <torch/csrc/jit/serialization/export.h>
#include <torch/csrc/jit/serialization/pickle.h>
#include <torch/csrc/jit/serialization/pickler.h>

#include <cinttypes>
#include <cstdio>
#include <exception>
#include <set>

#include "checkpoint_internal.h"
#include "dtrain/dist/error.h"

namespace dtrain::engine::ckpt_detail {
namespace {

using GenericDict = c10::impl::GenericDict;

GenericDict new_dict() { return GenericDict(c10::StringType::get(), c10::AnyType::get()); }

// A CPU tensor that owns exactly its elements (so the archive stores nothing else).
at::Tensor savable(const at::Tensor& tensor, const std::string& what, const std::string& name) {
  DTRAIN_CHECK(tensor.defined(), "checkpoint: ", what, " entry '", name,
               "' is an undefined tensor; leave it out instead");
  DTRAIN_CHECK(tensor.layout() == c10::kStrided && !tensor.is_quantized(), "checkpoint: ", what,
               " entry '", name, "' is not a dense tensor (", tensor.layout(), ")");
  at::Tensor t = tensor.detach();
  if (!t.device().is_cpu()) t = t.cpu();
  if (!t.is_contiguous() || t.storage_offset() != 0 || t.storage().nbytes() != t.nbytes()) {
    t = t.clone(at::MemoryFormat::Contiguous);
  }
  return t;
}

c10::Dict<std::string, at::Tensor> tensor_dict(const NamedTensors& named, const std::string& what) {
  c10::Dict<std::string, at::Tensor> dict;
  for (const auto& [name, tensor] : named) {
    DTRAIN_CHECK(!dict.contains(name), "checkpoint: ", what, " has the name '", name, "' twice");
    dict.insert(name, savable(tensor, what, name));
  }
  return dict;
}

c10::Dict<std::string, std::string> string_dict(const std::map<std::string, std::string>& map) {
  c10::Dict<std::string, std::string> dict;
  for (const auto& [key, value] : map) dict.insert(key, value);
  return dict;
}

GenericDict rng_dict(const RngState& rng) {
  GenericDict dict = new_dict();
  if (rng.cpu.defined()) dict.insert("cpu", savable(rng.cpu, "rng", "cpu"));
  // A generic list: a c10::List<at::Tensor> would be pickled as build_tensorlist, which
  // torch.load(weights_only=True) refuses.
  c10::impl::GenericList cuda(c10::AnyType::get());
  for (size_t i = 0; i < rng.cuda.size(); ++i) {
    cuda.push_back(savable(rng.cuda[i], "rng", "cuda:" + std::to_string(i)));
  }
  dict.insert("cuda", cuda);
  return dict;
}

GenericDict header(const char* kind, int64_t step) {
  GenericDict dict = new_dict();
  dict.insert("format", std::string(kFormat));
  dict.insert("version", kVersion);
  dict.insert("kind", std::string(kind));
  dict.insert("step", step);
  return dict;
}

void write_archive(const GenericDict& dict, const std::function<void(const char*, size_t)>& sink) {
  std::vector<char> pickle_bytes;
  // tag_aggregates=false: plain dicts and lists, which torch.load(weights_only=True) accepts
  // (tagged ones need torch.jit._pickle.restore_type_tag).
  torch::jit::Pickler pickler(
      [&](const char* p, size_t n) { pickle_bytes.insert(pickle_bytes.end(), p, p + n); },
      /*tensor_table=*/nullptr, /*type_renamer=*/nullptr, /*memoized_class_types=*/nullptr,
      /*get_tensor_id=*/nullptr, /*tag_aggregates=*/false);
  pickler.protocol();
  pickler.pushIValue(c10::IValue(dict));
  pickler.stop();
  // A sink failure must not unwind through miniz (C code), nor make the writer's destructor
  // throw: it is kept, the rest of the archive is discarded, and it is rethrown at the end.
  std::exception_ptr failure;
  {
    caffe2::serialize::PyTorchStreamWriter writer([&](const void* p, size_t n) -> size_t {
      if (!failure) {
        try {
          sink(static_cast<const char*>(p), n);
        } catch (...) {
          failure = std::current_exception();
        }
      }
      return n;
    });
    torch::jit::writeArchiveAndTensors("data", pickle_bytes.data(), pickle_bytes.size(),
                                       pickler.tensorData(), writer);
    writer.writeEndOfFile();
  }
  if (failure) std::rethrow_exception(failure);
}

// ---- reading ----------------------------------------------------------------------------------

const c10::IValue& entry(const GenericDict& dict, const char* key, const std::string& source) {
  auto it = dict.find(c10::IValue(std::string(key)));
  DTRAIN_CHECK(it != dict.end(), "checkpoint ", source, " has no '", key,
               "' entry; it was not written by dtrain's CheckpointStore");
  return it->value();
}

int64_t int_entry(const GenericDict& dict, const char* key, const std::string& source) {
  const c10::IValue& v = entry(dict, key, source);
  DTRAIN_CHECK(v.isInt(), "checkpoint ", source, ": '", key, "' is not an integer");
  return v.toInt();
}

std::string string_entry(const GenericDict& dict, const char* key, const std::string& source) {
  const c10::IValue& v = entry(dict, key, source);
  DTRAIN_CHECK(v.isString(), "checkpoint ", source, ": '", key, "' is not a string");
  return v.toStringRef();
}

GenericDict dict_entry(const GenericDict& dict, const char* key, const std::string& source) {
  const c10::IValue& v = entry(dict, key, source);
  DTRAIN_CHECK(v.isGenericDict(), "checkpoint ", source, ": '", key, "' is not a dict");
  return v.toGenericDict();
}

NamedTensors named_entry(const GenericDict& dict, const char* key, const std::string& source) {
  NamedTensors named;
  for (const auto& item : dict_entry(dict, key, source)) {
    DTRAIN_CHECK(item.key().isString() && item.value().isTensor(), "checkpoint ", source, ": '",
                 key, "' holds something other than name -> tensor");
    named.emplace_back(item.key().toStringRef(), item.value().toTensor());
  }
  return named;
}

std::map<std::string, std::string> meta_entry(const GenericDict& dict, const std::string& source) {
  std::map<std::string, std::string> meta;
  for (const auto& item : dict_entry(dict, "meta", source)) {
    DTRAIN_CHECK(item.key().isString() && item.value().isString(), "checkpoint ", source,
                 ": 'meta' holds something other than strings");
    meta.emplace(item.key().toStringRef(), item.value().toStringRef());
  }
  return meta;
}

RngState rng_entry(const GenericDict& dict, const std::string& source) {
  GenericDict rng = dict_entry(dict, "rng", source);
  RngState state;
  auto cpu = rng.find(c10::IValue(std::string("cpu")));
  if (cpu != rng.end()) state.cpu = cpu->value().toTensor();
  const c10::IValue& cuda = entry(rng, "cuda", source);
  DTRAIN_CHECK(cuda.isList(), "checkpoint ", source, ": rng 'cuda' is not a list");
  for (const c10::IValue& t : cuda.toListRef()) state.cuda.push_back(t.toTensor());
  return state;
}

// Parses bytes and checks the format tag, version and kind.
GenericDict read_archive(const std::vector<char>& bytes, const char* kind,
                         const std::string& source) {
  c10::IValue value;
  try {
    value = torch::jit::pickle_load(bytes);
  } catch (const std::exception& e) {
    std::string what = e.what();
    throw Error(detail::concat("checkpoint ", source, " is not a readable torch archive: ",
                               what.substr(0, what.find('\n'))));
  }
  DTRAIN_CHECK(value.isGenericDict(), "checkpoint ", source,
               " does not hold a dict; it was not written by dtrain's CheckpointStore");
  GenericDict dict = value.toGenericDict();
  DTRAIN_CHECK(string_entry(dict, "format", source) == kFormat, "checkpoint ", source,
               " is not a dtrain checkpoint (format '", string_entry(dict, "format", source), "')");
  const int64_t version = int_entry(dict, "version", source);
  DTRAIN_CHECK(version >= 1 && version <= kVersion, "checkpoint ", source, " has format version ",
               version, "; this build reads versions 1 to ", kVersion, "; use a newer dtrain");
  DTRAIN_CHECK(string_entry(dict, "kind", source) == kind, "checkpoint ", source, " is a '",
               string_entry(dict, "kind", source), "' file, expected '", kind, "'");
  return dict;
}

bool parse_digits(const std::string& s, size_t* pos, int64_t* value) {
  size_t start = *pos;
  int64_t v = 0;
  while (*pos < s.size() && s[*pos] >= '0' && s[*pos] <= '9' && *pos - start < 18) {
    v = v * 10 + (s[*pos] - '0');
    ++*pos;
  }
  *value = v;
  return *pos > start;
}

// The ranges of a rank's partitioned state: "shard_ranges" [b0, e0, b1, e1, ...] and
// "shard_unit_bounds", 1-D int64 tensors (torch.load(weights_only=True) reads them; integer
// lists it refuses), and for readers of one range "shard_begin" / "shard_end" (the first
// range's begin and the last one's end; numel twice when it holds nothing).
void write_shard_layout(GenericDict& dict, const ShardLayout& layout) {
  std::vector<int64_t> ranges;
  for (const FlatRange& r : layout.ranges) {
    if (r.begin == r.end) continue;
    ranges.push_back(r.begin);
    ranges.push_back(r.end);
  }
  auto longs = [](const std::vector<int64_t>& v) {
    return at::tensor(c10::ArrayRef<int64_t>(v), at::kLong).reshape({static_cast<int64_t>(v.size())});
  };
  dict.insert("shard_begin", ranges.empty() ? layout.numel : ranges.front());
  dict.insert("shard_end", ranges.empty() ? layout.numel : ranges.back());
  dict.insert("shard_ranges", longs(ranges));
  dict.insert("shard_unit_bounds", longs(layout.unit_bounds));
}

std::vector<int64_t> int_list_entry(const GenericDict& dict, const char* key, const std::string& source) {
  const c10::IValue& v = entry(dict, key, source);
  DTRAIN_CHECK(v.isTensor() && v.toTensor().dim() == 1 && v.toTensor().scalar_type() == at::kLong, "checkpoint ",
               source, ": '", key, "' is not a 1-D int64 tensor");
  const at::Tensor t = v.toTensor().contiguous();
  return std::vector<int64_t>(t.data_ptr<int64_t>(), t.data_ptr<int64_t>() + t.numel());
}

// The layout's ranges and unit bounds from the entries above; files of one range have only
// shard_begin / shard_end, and older ones the meta offload.begin / offload.end. Empty ranges
// (a rank that held only padding) are dropped.
void read_shard_layout(const GenericDict& dict, const std::map<std::string, std::string>& meta,
                       const std::string& source, ShardLayout* layout) {
  std::vector<int64_t> flat;
  if (dict.contains("shard_ranges")) {
    flat = int_list_entry(dict, "shard_ranges", source);
    DTRAIN_CHECK(flat.size() % 2 == 0, "checkpoint ", source, ": 'shard_ranges' holds ", flat.size(),
                 " numbers, not begin/end pairs");
    layout->unit_bounds = int_list_entry(dict, "shard_unit_bounds", source);
  } else if (dict.contains("shard_begin")) {
    flat = {int_entry(dict, "shard_begin", source), int_entry(dict, "shard_end", source)};
  } else if (meta.count("offload.begin") && meta.count("offload.end")) {
    // Written before the range had entries of its own (November 2026).
    flat = {std::stoll(meta.at("offload.begin")), std::stoll(meta.at("offload.end"))};
  }
  for (size_t i = 0; i + 1 < flat.size(); i += 2) {
    if (flat[i] != flat[i + 1]) layout->ranges.push_back({flat[i], flat[i + 1]});
  }
}

}  // namespace

void write_main_archive(const CheckpointData& data,
                        const std::function<void(const char*, size_t)>& sink) {
  GenericDict dict = header("main", data.step);
  dict.insert("world_size", static_cast<int64_t>(data.world_size));
  dict.insert("dp_size", static_cast<int64_t>(data.dp_size));
  dict.insert("rank_files", static_cast<int64_t>(data.rank_files));
  dict.insert("model", tensor_dict(data.model, "model"));
  dict.insert("optimizer", tensor_dict(data.optimizer, "optimizer"));
  dict.insert("scaler", tensor_dict(data.scaler, "scaler"));
  if (!data.masks.empty()) dict.insert("masks", tensor_dict(data.masks, "masks"));
  dict.insert("rng", rng_dict(data.rng));
  dict.insert("meta", string_dict(data.meta));
  write_archive(dict, sink);
}

void write_rank_archive(int64_t step, const RankState& state,
                        const std::function<void(const char*, size_t)>& sink) {
  GenericDict dict = header("rank", step);
  dict.insert("rank", static_cast<int64_t>(state.rank));
  dict.insert("dp_rank", static_cast<int64_t>(state.dp_rank));
  dict.insert("dp_size", static_cast<int64_t>(state.dp_size));
  dict.insert("tp_rank", static_cast<int64_t>(state.tp_rank));
  dict.insert("flat_numel", state.optimizer_shard.layout.numel);
  write_shard_layout(dict, state.optimizer_shard.layout);
  dict.insert("optimizer_shard", tensor_dict(state.optimizer_shard.tensors, "optimizer_shard"));
  if (!state.stage_model.empty()) {  // a pipeline stage's part of the model (torch.load sees it by name)
    dict.insert("model", tensor_dict(state.stage_model, "model"));
    dict.insert("optimizer", tensor_dict(state.stage_optimizer, "optimizer"));
  }
  dict.insert("rng", rng_dict(state.rng));
  dict.insert("meta", string_dict(state.meta));
  write_archive(dict, sink);
}

CheckpointData read_main_archive(const std::vector<char>& bytes, const std::string& source) {
  GenericDict dict = read_archive(bytes, "main", source);
  CheckpointData data;
  data.step = int_entry(dict, "step", source);
  data.world_size = static_cast<int>(int_entry(dict, "world_size", source));
  data.dp_size = static_cast<int>(int_entry(dict, "dp_size", source));
  data.rank_files = static_cast<int>(int_entry(dict, "rank_files", source));
  data.model = named_entry(dict, "model", source);
  data.optimizer = named_entry(dict, "optimizer", source);
  data.scaler = named_entry(dict, "scaler", source);
  if (dict.contains("masks")) data.masks = named_entry(dict, "masks", source);  // only pruned runs have it
  data.rng = rng_entry(dict, source);
  data.meta = meta_entry(dict, source);
  return data;
}

RankState read_rank_archive(const std::vector<char>& bytes, const std::string& source,
                            int64_t* step) {
  GenericDict dict = read_archive(bytes, "rank", source);
  RankState state;
  *step = int_entry(dict, "step", source);
  state.rank = static_cast<int>(int_entry(dict, "rank", source));
  state.dp_rank = static_cast<int>(int_entry(dict, "dp_rank", source));
  state.dp_size = static_cast<int>(int_entry(dict, "dp_size", source));
  state.tp_rank = static_cast<int>(int_entry(dict, "tp_rank", source));
  ShardState& shard = state.optimizer_shard;
  shard.layout.numel = int_entry(dict, "flat_numel", source);
  shard.tensors = named_entry(dict, "optimizer_shard", source);
  if (dict.contains("model")) {
    state.stage_model = named_entry(dict, "model", source);
    state.stage_optimizer = named_entry(dict, "optimizer", source);
  }
  state.rng = rng_entry(dict, source);
  state.meta = meta_entry(dict, source);
  read_shard_layout(dict, state.meta, source, &shard.layout);
  return state;
}

std::string format_record(const Record& record) {
  char line[160];
  std::snprintf(line, sizeof(line),
                "%s %" PRId64 " crc32c=%08" PRIx32 " bytes=%" PRIu64 " rank_files=%d\n", kFormat,
                kVersion, record.crc, record.bytes, record.rank_files);
  return line;
}

std::optional<Record> parse_record(const std::string& text) {
  char format[64] = {0};
  int64_t version = 0;
  uint32_t crc = 0;
  uint64_t bytes = 0;
  int rank_files = 0;
  int consumed = 0;
  int fields = std::sscanf(text.c_str(),
                           "%63s %" SCNd64 " crc32c=%8" SCNx32 " bytes=%" SCNu64 " rank_files=%d%n",
                           format, &version, &crc, &bytes, &rank_files, &consumed);
  if (fields != 5 || std::string(format) != kFormat || version != kVersion || rank_files < 0) {
    return std::nullopt;
  }
  std::string rest = text.substr(static_cast<size_t>(consumed));
  if (rest != "\n" && !rest.empty()) return std::nullopt;
  return Record{crc, bytes, rank_files};
}

std::optional<FileName> parse_file_name(const std::string& name) {
  static const std::string kPrefix = "step-";
  if (name.compare(0, kPrefix.size(), kPrefix) != 0) return std::nullopt;
  size_t pos = kPrefix.size();
  FileName file{FileName::kMain};
  if (!parse_digits(name, &pos, &file.step)) return std::nullopt;
  std::string rest = name.substr(pos);
  if (rest.find(".tmp.") != std::string::npos) {
    file.kind = FileName::kTemp;
    return file;
  }
  if (rest == ".pt") return file;
  if (rest == ".pt.crc") {
    file.kind = FileName::kMainRecord;
    return file;
  }
  static const std::string kRank = ".rank-";
  if (rest.compare(0, kRank.size(), kRank) != 0) return std::nullopt;
  size_t rpos = kRank.size();
  int64_t rank = 0;
  if (!parse_digits(rest, &rpos, &rank)) return std::nullopt;
  file.rank = static_cast<int>(rank);
  std::string tail = rest.substr(rpos);
  if (tail == ".pt") {
    file.kind = FileName::kRank;
  } else if (tail == ".pt.crc") {
    file.kind = FileName::kRankRecord;
  } else {
    return std::nullopt;
  }
  return file;
}

}  // namespace dtrain::engine::ckpt_detail
