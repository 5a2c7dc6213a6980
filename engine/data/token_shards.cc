// TokenShardDataset: finding the shard files, checking their headers, mapping them, and
// copying windows out of the mappings. The formats and rules are in token_shards.h.
#include "dtrain/engine/data/token_shards.h"

#include <ATen/ATen.h>
#include <dirent.h>
#include <fcntl.h>
#include <glob.h>
#include <glog/logging.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <cstdlib>
#include <iterator>
#include <map>
#include <memory>
#include <set>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "dtrain/dist/error.h"

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__,
              "token shards are little-endian on disk and read in place");

namespace dtrain::engine {
namespace {

constexpr int32_t kGpt2Magic = 20240520;
constexpr int32_t kGpt2Version = 1;
constexpr int32_t kLlama3Magic = 20240801;
constexpr int32_t kLlama3Version = 7;
constexpr int64_t kLlmcHeaderBytes = 1024;  // 256 int32
constexpr char kMegatronMagic[9] = {'M', 'M', 'I', 'D', 'I', 'D', 'X', '\0', '\0'};
constexpr int64_t kMegatronHeaderBytes = 34;  // magic, version, dtype code, two counts

template <typename T>
T read_le(const unsigned char* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}

// Copies n tokens of type T from src into dst (int64).
template <typename T>
void widen(const unsigned char* src, int64_t n, int64_t* dst) {
  for (int64_t i = 0; i < n; ++i)
    dst[i] = static_cast<int64_t>(read_le<T>(src + i * int64_t{sizeof(T)}));
}

// Token types on disk: each one's name, width and reader (kDtypes in Dtype's order).
enum class Dtype { kUint8, kInt16, kInt32, kInt64, kUint16, kUint32 };
struct DtypeInfo {
  const char* name;
  int64_t bytes;
  void (*copy)(const unsigned char* src, int64_t n, int64_t* dst);  // widen<T>
};
template <typename T>
constexpr DtypeInfo make_dtype_info(const char* name) {
  return {name, int64_t{sizeof(T)}, widen<T>};
}
constexpr DtypeInfo kDtypes[] = {
    make_dtype_info<uint8_t>("uint8"),   make_dtype_info<int16_t>("int16"),
    make_dtype_info<int32_t>("int32"),   make_dtype_info<int64_t>("int64"),
    make_dtype_info<uint16_t>("uint16"), make_dtype_info<uint32_t>("uint32")};
static_assert(std::size(kDtypes) == static_cast<size_t>(Dtype::kUint32) + 1, "one entry per Dtype");

const DtypeInfo& dtype_info(Dtype t) { return kDtypes[static_cast<int>(t)]; }
int64_t dtype_bytes(Dtype t) { return dtype_info(t).bytes; }
const char* dtype_name(Dtype t) { return dtype_info(t).name; }

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() &&
         s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

std::string base_name(const std::string& path) {
  const size_t slash = path.find_last_of('/');
  return slash == std::string::npos ? path : path.substr(slash + 1);
}

bool is_regular(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

// ---- A read-only mapping of a whole file ------------------------------------------------

class MappedFile {
 public:
  explicit MappedFile(std::string path) : path_(std::move(path)) {
    const int fd = ::open(path_.c_str(), O_RDONLY | O_CLOEXEC);
    DTRAIN_CHECK(fd >= 0, "cannot open the token shard '", path_, "': ", std::strerror(errno),
                 "; check the path and its read permission");
    struct stat st {};
    const bool stat_ok = ::fstat(fd, &st) == 0;
    if (!stat_ok || !S_ISREG(st.st_mode)) {
      const int err = stat_ok ? 0 : errno;
      ::close(fd);
      DTRAIN_CHECK(false, "the token shard '", path_, "' is not a regular file",
                   err ? std::string(" (") + std::strerror(err) + ")" : std::string(),
                   "; pass shard files, a directory of them or a glob pattern");
    }
    size_ = static_cast<int64_t>(st.st_size);
    if (size_ > 0) {
      void* p = ::mmap(nullptr, static_cast<size_t>(size_), PROT_READ, MAP_PRIVATE, fd, 0);
      const int err = errno;
      ::close(fd);
      DTRAIN_CHECK(p != MAP_FAILED, "cannot memory-map the token shard '", path_, "' (", size_,
                   " bytes): ", std::strerror(err),
                   "; check the address-space limit (ulimit -v) and the file system");
      data_ = static_cast<const unsigned char*>(p);
    } else {
      ::close(fd);
    }
  }
  ~MappedFile() {
    if (data_ && ::munmap(const_cast<unsigned char*>(data_), static_cast<size_t>(size_)) != 0) {
      LOG(WARNING) << "munmap of " << path_ << " failed: " << std::strerror(errno);
    }
  }
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  const unsigned char* data() const { return data_; }
  int64_t size() const { return size_; }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  const unsigned char* data_ = nullptr;
  int64_t size_ = 0;
};

// A mapped shard: tokens of `dtype` from byte `offset` of `file`.
struct Shard {
  TokenShardInfo info;
  std::unique_ptr<MappedFile> file;
  int64_t offset = 0;
  Dtype dtype = Dtype::kUint16;
};

int64_t windows_of(int64_t tokens, int64_t seq_len) {
  return tokens >= seq_len + 1 ? (tokens - 1) / seq_len : 0;
}

// ---- Which files --------------------------------------------------------------------------

// A file to open, or (megatron) a PREFIX of PREFIX.idx / PREFIX.bin.
struct Candidate {
  std::string path;
  bool megatron = false;
};

bool megatron_allowed(TokenFormat f) {
  return f == TokenFormat::kAuto || f == TokenFormat::kMegatron;
}

// The regular files of `dir` that may be shards (*.bin; *.idx too where Megatron is allowed),
// sorted by name; names starting with '.' are skipped.
std::vector<std::string> list_directory(const std::string& dir, TokenFormat format) {
  DIR* handle = ::opendir(dir.c_str());
  DTRAIN_CHECK(handle != nullptr, "cannot list the token-shard directory '", dir,
               "': ", std::strerror(errno), "; check its permissions");
  std::vector<std::string> names;
  while (const dirent* entry = ::readdir(handle)) {
    const std::string name = entry->d_name;
    if (name.empty() || name[0] == '.') continue;
    if (!ends_with(name, ".bin") && !(megatron_allowed(format) && ends_with(name, ".idx")))
      continue;
    if (is_regular(dir + "/" + name)) names.push_back(name);
  }
  ::closedir(handle);
  std::sort(names.begin(), names.end());
  std::vector<std::string> paths;
  const std::string prefix = dir.back() == '/' ? dir : dir + "/";
  for (const std::string& n : names) paths.push_back(prefix + n);
  return paths;
}

// The regular files matching a glob pattern, sorted (glob(3) sorts).
std::vector<std::string> glob_files(const std::string& pattern) {
  glob_t g{};
  const int rc = ::glob(pattern.c_str(), 0, nullptr, &g);
  std::vector<std::string> out;
  if (rc == 0) {
    for (size_t i = 0; i < g.gl_pathc; ++i) {
      if (is_regular(g.gl_pathv[i])) out.emplace_back(g.gl_pathv[i]);
    }
  }
  ::globfree(&g);
  DTRAIN_CHECK(rc == 0 || rc == GLOB_NOMATCH, "the glob pattern '", pattern,
               "' could not be expanded (glob error ", rc, "); check the directories it names");
  return out;
}

// Appends the shards among `files`: a Megatron pair (PREFIX.idx, or PREFIX.bin with
// PREFIX.idx beside it) once, at its first file; every other file as itself.
void add_files(const std::vector<std::string>& files, TokenFormat format,
               std::vector<Candidate>& out, std::set<std::string>& prefixes) {
  for (const std::string& f : files) {
    if (megatron_allowed(format)) {
      const std::string prefix = f.substr(0, f.size() >= 4 ? f.size() - 4 : 0);
      const bool pair =
          ends_with(f, ".idx") || (ends_with(f, ".bin") && is_regular(prefix + ".idx"));
      if (pair) {
        if (prefixes.insert(prefix).second) out.push_back({prefix, true});
        continue;
      }
    }
    out.push_back({f, false});
  }
}

bool has_glob_chars(const std::string& s) { return s.find_first_of("*?[") != std::string::npos; }

std::vector<Candidate> expand_paths(const TokenShardOptions& o) {
  std::vector<Candidate> out;
  std::set<std::string> prefixes;
  for (const std::string& p : o.paths) {
    DTRAIN_CHECK(!p.empty(),
                 "TokenShardOptions::paths holds an empty path; pass shard files, "
                 "directories, glob patterns or Megatron prefixes");
    struct stat st {};
    if (::stat(p.c_str(), &st) == 0 && S_ISDIR(st.st_mode)) {
      std::vector<std::string> files = list_directory(p, o.format);
      DTRAIN_CHECK(
          !files.empty(), "the token-shard directory '", p,
          "' holds no shard files (expected *.bin", megatron_allowed(o.format) ? " or *.idx" : "",
          " files); point paths at the directory that holds the shards, or at a glob pattern "
          "matching them");
      add_files(files, o.format, out, prefixes);
    } else if (::stat(p.c_str(), &st) == 0) {
      add_files({p}, o.format, out, prefixes);
    } else if (has_glob_chars(p)) {
      std::vector<std::string> files = glob_files(p);
      DTRAIN_CHECK(!files.empty(), "no regular file matches the token-shard pattern '", p,
                   "'; check the directory and the pattern (e.g. 'data/fineweb_train_*.bin')");
      add_files(files, o.format, out, prefixes);
    } else if (megatron_allowed(o.format) && is_regular(p + ".idx")) {
      if (prefixes.insert(p).second) out.push_back({p, true});
    } else {
      DTRAIN_CHECK(false, "the token-shard path '", p,
                   "' does not exist: expected a shard file, a directory "
                   "of shards, a glob pattern matching shards, or a Megatron prefix (PREFIX for "
                   "PREFIX.idx and "
                   "PREFIX.bin); check the path");
    }
  }
  // A shard named twice (a directory and a pattern over it, one file under two names) would be
  // read twice as often as the others, without a word.
  std::map<std::string, std::string> seen;  // real path -> the first name
  for (const Candidate& c : out) {
    char* real = ::realpath((c.megatron ? c.path + ".bin" : c.path).c_str(), nullptr);
    const std::string key = real ? real : c.path;
    std::free(real);
    auto [it, fresh] = seen.emplace(key, c.path);
    DTRAIN_CHECK(fresh, "the token shard '", c.path, "' is named twice in the paths",
                 it->second == c.path ? "" : " (also as '" + it->second + "')",
                 ": it would be read twice as often as the others; name each shard once");
  }
  return out;
}

// ---- The formats --------------------------------------------------------------------------

Shard open_llmc(std::unique_ptr<MappedFile> file) {
  const std::string& path = file->path();
  const int64_t size = file->size();
  DTRAIN_CHECK(
      size >= kLlmcHeaderBytes, "the llm.c token shard '", path, "' is ", size,
      " bytes, shorter than the ", kLlmcHeaderBytes,
      "-byte llm.c header (256 int32: magic, version, token count, ...); the file is empty or "
      "cut short: write it again");
  const unsigned char* d = file->data();
  const int32_t magic = read_le<int32_t>(d), version = read_le<int32_t>(d + 4);
  const int32_t count = read_le<int32_t>(d + 8);
  const bool gpt2 = magic == kGpt2Magic;
  DTRAIN_CHECK(
      gpt2 || magic == kLlama3Magic, "the llm.c token shard '", path, "' has magic ", magic,
      ", expected ", kGpt2Magic, " (GPT-2, uint16 tokens) or ", kLlama3Magic,
      " (Llama 3, uint32 tokens); it is not an llm.c shard (a headerless nanoGPT file needs format "
      "raw, a Megatron .bin its .idx beside it)");
  const int32_t want = gpt2 ? kGpt2Version : kLlama3Version;
  DTRAIN_CHECK(version == want, "the llm.c token shard '", path, "' has header version ", version,
               ", expected ", want, " for magic ", magic,
               gpt2 ? " (GPT-2 shards, uint16 tokens)" : " (Llama 3 shards, uint32 tokens)",
               "; write the shard again with llm.c's current write_datafile");
  DTRAIN_CHECK(
      count >= 0, "the llm.c token shard '", path, "' has token count ", count,
      " in its header, expected a count >= 0; the header is damaged: write the shard again");
  Shard s;
  s.dtype = gpt2 ? Dtype::kUint16 : Dtype::kUint32;
  const int64_t width = dtype_bytes(s.dtype);
  const int64_t expected = kLlmcHeaderBytes + int64_t{count} * width;
  DTRAIN_CHECK(size == expected, "the llm.c token shard '", path, "' is ", size,
               " bytes, but its header says ", count, " tokens: expected ", kLlmcHeaderBytes, " + ",
               count, " * ", width, " = ", expected, " bytes (the file holds ",
               (size - kLlmcHeaderBytes) / width, " tokens); ",
               size < expected ? "it was cut short or not written completely"
                               : "it holds more than its header says",
               ": write it again");
  s.offset = kLlmcHeaderBytes;
  s.info.format = TokenFormat::kLlmc;
  s.info.tokens = count;
  s.file = std::move(file);
  return s;
}

Shard open_raw(std::unique_ptr<MappedFile> file, int width) {
  const std::string& path = file->path();
  const int64_t size = file->size();
  const char* type = width == 2 ? "uint16" : "uint32";
  DTRAIN_CHECK(size > 0, "the raw token file '", path, "' is empty (0 bytes); expected ", type,
               " tokens (format raw); write it again or leave it out");
  DTRAIN_CHECK(size % width == 0, "the raw token file '", path, "' is ", size,
               " bytes, expected a multiple of ", width, " (", type,
               " tokens, raw_token_bytes = ", width,
               "); it was cut short, or holds tokens of another width (raw_token_bytes = ",
               width == 2 ? 4 : 2, ")");
  // An llm.c shard read as headerless tokens would train on its 1 KiB header as tokens.
  if (size >= 1024) {
    int32_t magic = 0;
    std::memcpy(&magic, file->data(), sizeof magic);  // little-endian, as the formats are
    DTRAIN_CHECK(magic != kGpt2Magic && magic != kLlama3Magic, "the token file '", path,
                 "' starts with llm.c's shard header (magic ", magic, "), but is read as headerless ", type,
                 " tokens (format raw: --data_format=raw|raw32 in dtrain's programs), which would train on the "
                 "header as tokens; read it as an llm.c shard (--data_format=auto or llmc)");
  }
  Shard s;
  s.dtype = width == 2 ? Dtype::kUint16 : Dtype::kUint32;
  s.info.format = TokenFormat::kRaw;
  s.info.tokens = size / width;
  s.file = std::move(file);
  return s;
}

// The dtype of a Megatron dtype code; throws for float, int8 and unknown codes.
Dtype megatron_dtype(int code, const std::string& idx) {
  switch (code) {
    case 1:
      return Dtype::kUint8;
    case 3:
      return Dtype::kInt16;
    case 4:
      return Dtype::kInt32;
    case 5:
      return Dtype::kInt64;
    case 8:
      return Dtype::kUint16;
    default:
      break;
  }
  const char* what = code == 6   ? " (float64): floats are not token ids"
                     : code == 7 ? " (float32): floats are not token ids"
                     : code == 2 ? " (int8): too narrow for a vocabulary"
                                 : ", which Megatron does not define";
  DTRAIN_CHECK(
      false, "the Megatron index '", idx, "' has dtype code ", code, what,
      "; expected an integer token type: 1 (uint8), 3 (int16), 4 (int32), 5 (int64) or 8 (uint16). "
      "Build the dataset from token ids (e.g. Megatron's preprocess_data.py)");
  return Dtype::kUint8;
}

struct MegatronIndex {
  Dtype dtype = Dtype::kUint16;
  int64_t tokens = 0;
  int64_t documents = 0;
};

// Reads and checks the header of a mapped .idx (magic, version, dtype, size).
MegatronIndex megatron_header(const MappedFile& f, int64_t* sequences) {
  const std::string& idx = f.path();
  const int64_t size = f.size();
  DTRAIN_CHECK(size >= kMegatronHeaderBytes, "the Megatron index '", idx, "' is ", size,
               " bytes, shorter than its ", kMegatronHeaderBytes,
               "-byte header (9-byte magic MMIDIDX\\x00\\x00, uint64 version, uint8 dtype code, "
               "uint64 sequence and document counts); it is empty or cut short: build it again");
  const unsigned char* d = f.data();
  if (std::memcmp(d, kMegatronMagic, sizeof(kMegatronMagic)) != 0) {
    std::ostringstream found;
    for (int i = 0; i < 9; ++i) {
      if (d[i] >= 0x20 && d[i] < 0x7f)
        found << static_cast<char>(d[i]);
      else
        found << "\\x"
              << "0123456789abcdef"[d[i] >> 4] << "0123456789abcdef"[d[i] & 15];
    }
    DTRAIN_CHECK(false, "the Megatron index '", idx, "' begins with '", found.str(),
                 "', expected the magic 'MMIDIDX\\x00\\x00' of a Megatron mmap indexed dataset; "
                 "it is not one (or of the older 'cached' kind, which is not read)");
  }
  const uint64_t version = read_le<uint64_t>(d + 9);
  DTRAIN_CHECK(version == 1, "the Megatron index '", idx, "' has version ", version,
               ", expected 1 (the only version Megatron writes)");
  MegatronIndex m;
  m.dtype = megatron_dtype(d[17], idx);
  const uint64_t n = read_le<uint64_t>(d + 18), docs = read_le<uint64_t>(d + 26);
  const auto body = static_cast<uint64_t>(size - kMegatronHeaderBytes);
  const bool fits = n <= body / 12 && docs <= body / 8;
  const uint64_t need = fits ? 12 * n + 8 * docs : 0;
  DTRAIN_CHECK(fits && (body == need || body == need + n), "the Megatron index '", idx, "' is ",
               size, " bytes, but its header's ", n, " sequences and ", docs,
               " document indices need ", kMegatronHeaderBytes, " + 12 * ", n, " + 8 * ", docs,
               " bytes (+ ", n,
               " with multimodal modes); it was cut short or is damaged: build it again");
  *sequences = static_cast<int64_t>(n);
  m.documents = docs > 0 ? static_cast<int64_t>(docs) - 1 : 0;
  return m;
}

// Checks the sequence lengths and pointers of a mapped .idx: lengths >= 0, pointers contiguous.
MegatronIndex read_megatron_index(const MappedFile& f) {
  int64_t n = 0;
  MegatronIndex m = megatron_header(f, &n);
  const unsigned char* lengths = f.data() + kMegatronHeaderBytes;
  const unsigned char* pointers = lengths + 4 * n;
  const int64_t width = dtype_bytes(m.dtype);
  int64_t at = 0;  // bytes of the sequences before sequence i
  for (int64_t i = 0; i < n; ++i) {
    const int32_t len = read_le<int32_t>(lengths + 4 * i);
    const int64_t ptr = read_le<int64_t>(pointers + 8 * i);
    DTRAIN_CHECK(len >= 0, "the Megatron index '", f.path(), "' gives sequence ", i, " the length ",
                 len, ", expected a length >= 0; the index is damaged: build it again");
    DTRAIN_CHECK(
        ptr == at, "the Megatron index '", f.path(), "' starts sequence ", i, " at byte ", ptr,
        " of the .bin, expected byte ", at,
        " (where the sequences before it end): only contiguous .bin files, as Megatron's builders "
        "write them, are read");
    at += int64_t{len} * width;
  }
  m.tokens = at / width;
  return m;
}

Shard open_megatron(const std::string& prefix) {
  const std::string idx = prefix + ".idx", bin = prefix + ".bin";
  DTRAIN_CHECK(
      is_regular(bin), "the Megatron index '", idx, "' has no data file '", bin,
      "' beside it; a Megatron dataset is PREFIX.idx with PREFIX.bin: copy the .bin next to it");
  MegatronIndex m;
  {
    MappedFile index(idx);  // unmapped once checked
    m = read_megatron_index(index);
  }
  auto file = std::make_unique<MappedFile>(bin);
  const int64_t width = dtype_bytes(m.dtype);
  DTRAIN_CHECK(
      file->size() == m.tokens * width, "the Megatron data file '", bin, "' is ", file->size(),
      " bytes, but its index '", idx, "' gives ", m.tokens, " ", dtype_name(m.dtype),
      " tokens: expected ", m.tokens, " * ", width, " = ", m.tokens * width,
      " bytes; the .bin and .idx are not of one build, or one was cut short: build them again");
  Shard s;
  s.dtype = m.dtype;
  s.info.format = TokenFormat::kMegatron;
  s.info.tokens = m.tokens;
  s.info.documents = m.documents;
  s.file = std::move(file);
  return s;
}

Shard open_candidate(const Candidate& c, const TokenShardOptions& o) {
  if (c.megatron) return open_megatron(c.path);
  if (o.format == TokenFormat::kMegatron) {
    const std::string prefix =
        ends_with(c.path, ".bin") ? c.path.substr(0, c.path.size() - 4) : c.path;
    DTRAIN_CHECK(
        false, "the token file '", c.path, "' has no Megatron index '", prefix,
        ".idx' beside it (format megatron); copy the .idx next to it, or pick the file's format "
        "(llmc, raw)");
  }
  auto file = std::make_unique<MappedFile>(c.path);
  if (o.format == TokenFormat::kRaw) return open_raw(std::move(file), o.raw_token_bytes);
  if (o.format == TokenFormat::kAuto) {
    const int32_t magic = file->size() >= 4 ? read_le<int32_t>(file->data()) : 0;
    DTRAIN_CHECK(magic == kGpt2Magic || magic == kLlama3Magic, "the token file '", c.path, "' (",
                 file->size(), " bytes) is not a recognized shard: ",
                 file->size() >= 4
                     ? "its first int32 is " + std::to_string(magic)
                     : std::string(file->size() == 0 ? "it is empty" : "it is too short"),
                 ", expected an llm.c magic, ", kGpt2Magic, " (GPT-2) or ", kLlama3Magic,
                 " (Llama 3), and there is no Megatron .idx beside it. For a headerless nanoGPT "
                 "file pass format "
                 "raw (raw_token_bytes 2 for uint16, 4 for uint32)");
  }
  return open_llmc(std::move(file));
}

void copy_tokens(Dtype t, const unsigned char* src, int64_t n, int64_t* dst) {
  dtype_info(t).copy(src, n, dst);
}

// The formats' names (token_format_name, parse_token_format).
constexpr std::pair<TokenFormat, const char*> kTokenFormatNames[] = {
    {TokenFormat::kAuto, "auto"},
    {TokenFormat::kLlmc, "llmc"},
    {TokenFormat::kRaw, "raw"},
    {TokenFormat::kMegatron, "megatron"}};

std::string format_label(const TokenShardInfo& s) {
  return std::string(token_format_name(s.format)) + " " + s.dtype;
}

}  // namespace

// ---- Public ---------------------------------------------------------------------------------

const char* token_format_name(TokenFormat format) {
  for (const auto& [f, name] : kTokenFormatNames) {
    if (f == format) return name;
  }
  return "?";
}

TokenFormat parse_token_format(const std::string& name) {
  for (const auto& [f, f_name] : kTokenFormatNames) {
    if (name == f_name) return f;
  }
  DTRAIN_CHECK(false, "token-shard format '", name,
               "' does not exist; use auto (detect llm.c and Megatron), "
               "llmc, raw (headerless nanoGPT tokens) or megatron");
  return TokenFormat::kAuto;
}

class TokenShardDataset::Impl {
 public:
  std::vector<Shard> shards;
  std::vector<int64_t> starts;  // starts[s]: the first sample of shard s; starts.back() = size()
};

namespace {

// The error for shards that hold no window: names seq_len and the token counts.
[[noreturn]] void throw_no_window(const std::vector<TokenShardInfo>& infos, int64_t seq_len) {
  std::ostringstream list;
  int64_t longest = 0;
  for (size_t i = 0; i < infos.size(); ++i) {
    longest = std::max(longest, infos[i].tokens);
    if (i < 8)
      list << (i ? ", " : "") << base_name(infos[i].path) << ": " << infos[i].tokens << " tokens";
  }
  if (infos.size() > 8) list << ", ... (" << infos.size() - 8 << " more)";
  throw Error(detail::concat("the ", infos.size(), " token shard(s) (", list.str(),
                             ") hold no window of seq_len + 1 = ", seq_len + 1,
                             " tokens (the longest has ", longest, "); lower seq_len to at most ",
                             std::max<int64_t>(longest - 1, 0), " or add longer shards"));
}

}  // namespace

TokenShardDataset::TokenShardDataset(TokenShardOptions options)
    : options_(std::move(options)), impl_(std::make_unique<Impl>()) {
  const TokenShardOptions& o = options_;
  DTRAIN_CHECK(!o.paths.empty(),
               "TokenShardOptions::paths is empty; pass shard files, a directory of "
               "shards, a glob pattern (e.g. 'data/fineweb_train_*.bin') or a Megatron prefix");
  DTRAIN_CHECK(o.seq_len >= 1, "TokenShardOptions::seq_len is ", o.seq_len,
               "; pass the model's sequence length (>= 1)");
  DTRAIN_CHECK(o.raw_token_bytes == 2 || o.raw_token_bytes == 4,
               "TokenShardOptions::raw_token_bytes is ", o.raw_token_bytes,
               "; use 2 (uint16 tokens, nanoGPT's default) or 4 (uint32)");
  DTRAIN_CHECK(o.vocab >= 0, "TokenShardOptions::vocab is ", o.vocab,
               "; pass the model's vocabulary size, or 0 for no check");
  impl_->starts.push_back(0);
  for (const Candidate& c : expand_paths(o)) {
    Shard s = open_candidate(c, o);
    s.info.path = s.file->path();
    s.info.dtype = dtype_name(s.dtype);
    s.info.windows = windows_of(s.info.tokens, o.seq_len);
    infos_.push_back(s.info);
    impl_->starts.push_back(impl_->starts.back() + s.info.windows);
    impl_->shards.push_back(std::move(s));
  }
  if (impl_->starts.back() == 0) throw_no_window(infos_, o.seq_len);
}

TokenShardDataset::~TokenShardDataset() = default;

int64_t TokenShardDataset::size() const { return impl_->starts.back(); }

int64_t TokenShardDataset::total_tokens() const {
  int64_t total = 0;
  for (const TokenShardInfo& s : infos_) total += s.tokens;
  return total;
}

std::vector<at::Tensor> TokenShardDataset::get_batch(const std::vector<int64_t>& indices) const {
  const int64_t n = size(), S = options_.seq_len, vocab = options_.vocab;
  const auto rows = static_cast<int64_t>(indices.size());
  at::Tensor out = at::empty({rows, S + 1}, at::kLong);
  int64_t* dst = out.data_ptr<int64_t>();
  const std::vector<int64_t>& starts = impl_->starts;
  for (int64_t r = 0; r < rows; ++r, dst += S + 1) {
    const int64_t i = indices[static_cast<size_t>(r)];
    DTRAIN_CHECK(i >= 0 && i < n, "TokenShardDataset::get_batch: index ", i, " is outside [0, ", n,
                 "); pass window indices below size()");
    // The last shard whose first window is <= i (shards of 0 windows share their start).
    const auto s =
        static_cast<size_t>(std::upper_bound(starts.begin(), starts.end(), i) - starts.begin() - 1);
    const Shard& shard = impl_->shards[s];
    const int64_t first = (i - starts[s]) * S;  // the window's first token in its shard
    copy_tokens(shard.dtype, shard.file->data() + shard.offset + first * dtype_bytes(shard.dtype),
                S + 1, dst);
    for (int64_t k = 0; k <= S; ++k) {
      const int64_t t = dst[k];
      if (t >= 0 && (vocab == 0 || t < vocab)) continue;
      DTRAIN_CHECK(t >= 0, "the token shard '", shard.info.path, "' holds token ", t,
                   " at token offset ", first + k, " (", shard.info.dtype,
                   "), expected token ids >= 0; the shard is damaged or was written with "
                   "another dtype");
      DTRAIN_CHECK(false, "the token shard '", shard.info.path, "' holds token ", t,
                   " at token offset ", first + k, ", expected tokens below the vocab ", vocab,
                   ": the model would index its embedding out of range. Pass the tokenizer's "
                   "vocabulary size (>= ", t + 1, ") as the vocab, or re-tokenize the shard for "
                   "this model");
    }
  }
  return {out};
}

std::string TokenShardDataset::describe() const {
  std::ostringstream os;
  os << "token shards: " << infos_.size() << (infos_.size() == 1 ? " file (" : " files (");
  for (size_t i = 0; i < infos_.size(); ++i) {
    if (infos_.size() > 4 && i == 3) {
      os << ", ... " << infos_.size() - 4 << " more, " << base_name(infos_.back().path);
      break;
    }
    os << (i ? ", " : "") << base_name(infos_[i].path);
  }
  os << "), ";
  std::vector<std::string> labels;
  for (const TokenShardInfo& s : infos_) {
    if (std::find(labels.begin(), labels.end(), format_label(s)) == labels.end())
      labels.push_back(format_label(s));
  }
  for (size_t i = 0; i < labels.size(); ++i) os << (i ? " + " : "") << labels[i];
  const int64_t S = options_.seq_len;
  os << ", " << total_tokens() << " tokens, " << size() << " windows of seq_len " << S << " ("
     << S + 1 << " tokens each, stride " << S << ")";
  const auto short_shards = std::count_if(infos_.begin(), infos_.end(),
                                          [](const TokenShardInfo& s) { return s.windows == 0; });
  if (short_shards > 0) os << "; " << short_shards << " shard(s) too short for a window";
  if (options_.vocab > 0) os << "; each window's tokens checked below vocab " << options_.vocab << " as it is read";
  return os.str();
}

}  // namespace dtrain::engine
