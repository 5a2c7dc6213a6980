// dtrain-prepare's library (prepare.h): inputs, documents, parallel encoding, atomic shards.
#include "prepare.h"

#include <nlohmann/json.hpp>

#include <dirent.h>
#include <fcntl.h>
#include <glob.h>
#include <glog/logging.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <fstream>
#include <iterator>
#include <map>
#include <mutex>
#include <sstream>
#include <thread>
#include <utility>

#include "text_stream.h"

namespace dtrain::prepare {
namespace {

template <typename... Args>
[[noreturn]] void fail(const Args&... args) {
  std::ostringstream os;
  (os << ... << args);
  throw PrepareError(os.str());
}

std::string errno_text() { return std::strerror(errno); }

bool stat_path(const std::string& path, struct stat* st) { return ::stat(path.c_str(), st) == 0; }

bool is_regular(const std::string& path) {
  struct stat st;
  return stat_path(path, &st) && S_ISREG(st.st_mode);
}

bool has_glob_chars(const std::string& s) { return s.find_first_of("*?[") != std::string::npos; }

std::vector<std::string> directory_names(const std::string& dir) {
  std::vector<std::string> names;
  DIR* d = ::opendir(dir.c_str());
  if (!d) fail("cannot list the directory ", dir, ": ", errno_text());
  while (const dirent* e = ::readdir(d)) names.emplace_back(e->d_name);
  ::closedir(d);
  std::sort(names.begin(), names.end());
  return names;
}

std::vector<std::string> directory_files(const std::string& dir) {
  std::vector<std::string> files;
  for (const std::string& name : directory_names(dir)) {
    if (name.empty() || name[0] == '.') continue;
    const std::string path = dir + "/" + name;
    if (is_regular(path)) files.push_back(path);
  }
  if (files.empty()) fail("--input: the directory ", dir, " holds no regular files (names starting with '.' are skipped)");
  return files;
}

std::vector<std::string> glob_files(const std::string& pattern) {
  glob_t g{};
  const int rc = ::glob(pattern.c_str(), 0, nullptr, &g);
  std::vector<std::string> files;
  if (rc == 0) {
    for (size_t i = 0; i < g.gl_pathc; ++i) {
      if (is_regular(g.gl_pathv[i])) files.emplace_back(g.gl_pathv[i]);
    }
  }
  ::globfree(&g);
  if (files.empty()) fail("--input: the pattern ", pattern, " matches no regular file");
  std::sort(files.begin(), files.end());
  return files;
}

void fsync_directory(const std::string& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY);
  if (fd < 0) return;
  ::fsync(fd);  // best effort: some file systems refuse fsync on a directory
  ::close(fd);
}

std::string parent_of(const std::string& path) {
  const size_t slash = path.rfind('/');
  if (slash == std::string::npos) return ".";
  return slash == 0 ? "/" : path.substr(0, slash);
}

// Renames tmp to path unless path exists (no silent overwrite, even against a racing writer).
void publish(const std::string& tmp, const std::string& path) {
  if (::renameat2(AT_FDCWD, tmp.c_str(), AT_FDCWD, path.c_str(), RENAME_NOREPLACE) == 0) return;
  if (errno == EEXIST) fail(path, " appeared while it was being written: remove it or choose another --prefix");
  if (errno != EINVAL && errno != ENOSYS) fail("cannot rename ", tmp, " to ", path, ": ", errno_text());
  // A file system without RENAME_NOREPLACE: a hard link fails the same way on an existing name.
  if (::link(tmp.c_str(), path.c_str()) == 0) {
    ::unlink(tmp.c_str());
    return;
  }
  if (errno == EEXIST) fail(path, " appeared while it was being written: remove it or choose another --prefix");
  struct stat st;
  if (stat_path(path, &st)) fail(path, " appeared while it was being written: remove it or choose another --prefix");
  if (::rename(tmp.c_str(), path.c_str()) != 0) fail("cannot rename ", tmp, " to ", path, ": ", errno_text());
}

void put_le(unsigned char* out, uint32_t v, int bytes) {
  for (int b = 0; b < bytes; ++b) out[b] = static_cast<unsigned char>(v >> (8 * b));
}

void write_all(int fd, const unsigned char* data, size_t n, const std::string& path) {
  while (n > 0) {
    const ssize_t w = ::write(fd, data, n);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) fail("cannot write ", path, ": ", errno_text());
    data += w;
    n -= static_cast<size_t>(w);
  }
}

// ---- the progress line's parts ----------------------------------------------------------------

// v with three significant digits and no more ("9.99", "10.0", "123"); v < 999.5.
std::string three_digits(double v) {
  char buf[32];
  const char* format = v < 9.995 ? "%.2f" : v < 99.95 ? "%.1f" : "%.0f";
  std::snprintf(buf, sizeof(buf), format, v);
  return buf;
}

// A count: "999", then "1.23k", "45.6M", "789G".
std::string count_text(double n) {
  if (n < 999.5) return std::to_string(static_cast<int64_t>(std::llround(std::max(n, 0.0))));
  const char* units[] = {"k", "M", "G", "T"};
  double scaled = n / 1000;
  size_t u = 0;
  while (scaled >= 999.5 && u + 1 < std::size(units)) {
    scaled /= 1000;
    ++u;
  }
  return three_digits(scaled) + units[u];
}

// "12.3/45.6 MB": both in the unit of the total.
std::string bytes_text(int64_t bytes, int64_t total) {
  const char* units[] = {"B", "kB", "MB", "GB", "TB"};
  double scale = 1;
  size_t u = 0;
  while (static_cast<double>(total) / scale >= 999.5 && u + 1 < std::size(units)) {
    scale *= 1000;
    ++u;
  }
  if (u == 0) return std::to_string(bytes) + "/" + std::to_string(total) + " B";
  return three_digits(static_cast<double>(bytes) / scale) + "/" + three_digits(static_cast<double>(total) / scale) +
         " " + units[u];
}

// "0:07", "59:59", then hours and minutes: "1h02m".
std::string duration_text(double seconds) {
  const int64_t s = static_cast<int64_t>(std::min(std::max(seconds, 0.0), 1e12));
  char buf[48];
  if (s < 3600) {
    std::snprintf(buf, sizeof(buf), "%lld:%02lld", static_cast<long long>(s / 60), static_cast<long long>(s % 60));
  } else {
    std::snprintf(buf, sizeof(buf), "%lldh%02lldm", static_cast<long long>(s / 3600),
                  static_cast<long long>(s / 60 % 60));
  }
  return buf;
}

}  // namespace

std::string format_progress(const ProgressSnapshot& p) {
  constexpr int kBar = 10;
  double share = p.total_bytes > 0 ? static_cast<double>(p.bytes) / static_cast<double>(p.total_bytes) : 0.0;
  if (p.done) share = 1.0;
  share = std::clamp(share, 0.0, 1.0);
  const int filled = static_cast<int>(share * kBar);
  char percent[16];
  std::snprintf(percent, sizeof(percent), "%d%%", static_cast<int>(share * 100));
  std::string line = "[" + std::string(filled, '#') + std::string(kBar - filled, '-') + "] " + percent;
  line += " " + bytes_text(p.bytes, p.total_bytes);
  line += " " + count_text(static_cast<double>(p.documents)) + " docs";
  line += " " + count_text(static_cast<double>(p.tokens)) + " tok";
  const double rate = p.seconds > 0 ? static_cast<double>(p.tokens) / p.seconds : 0.0;
  line += " " + count_text(rate) + " tok/s " + duration_text(p.seconds);
  if (p.done) return line + " done";
  if (p.bytes <= 0 || p.seconds <= 0) return line + " ETA ?";
  const double left = static_cast<double>(std::max<int64_t>(p.total_bytes - p.bytes, 0));
  return line + " ETA " + duration_text(left * p.seconds / static_cast<double>(p.bytes));
}

const char* document_mode_name(DocumentMode mode) {
  return mode == DocumentMode::kFile ? "file" : mode == DocumentMode::kLines ? "lines" : "jsonl";
}

DocumentMode parse_document_mode(const std::string& name) {
  if (name == "file") return DocumentMode::kFile;
  if (name == "lines") return DocumentMode::kLines;
  if (name == "jsonl") return DocumentMode::kJsonl;
  fail("--documents=", name, ": choose file (each input file is one document), lines (each non-empty line is one) "
       "or jsonl (each line a JSON object whose --jsonl_field holds one)");
}

ShardFormat shard_format_for_vocab(int64_t vocab) {
  if (vocab < 1 || vocab > (int64_t{1} << 32)) fail("a vocabulary of ", vocab, " entries has no llm.c shard format");
  if (vocab <= 65536) return {kGpt2Magic, 1, 2};
  return {kLlama3Magic, 7, 4};
}

std::string shard_name(const std::string& prefix, bool val, int64_t index) {
  char digits[32];
  std::snprintf(digits, sizeof(digits), "%06lld", static_cast<long long>(index));
  return prefix + (val ? "_val_" : "_train_") + digits + ".bin";
}

std::vector<std::string> expand_inputs(const std::vector<std::string>& inputs) {
  if (inputs.empty()) fail("--input is empty: name text files, directories or glob patterns, separated by commas");
  std::vector<std::string> files;
  for (const std::string& entry : inputs) {
    struct stat st;
    std::vector<std::string> more;
    if (entry.empty()) fail("--input has an empty entry (two commas in a row?)");
    if (stat_path(entry, &st) && S_ISDIR(st.st_mode)) {
      more = directory_files(entry);
    } else if (stat_path(entry, &st)) {
      if (!S_ISREG(st.st_mode)) fail("--input: ", entry, " is not a regular file");
      more = {entry};
    } else if (has_glob_chars(entry)) {
      more = glob_files(entry);
    } else {
      fail("--input: ", entry, " does not exist (", errno_text(), ")");
    }
    files.insert(files.end(), more.begin(), more.end());
  }
  // A file named twice (a directory and a pattern over it) would be encoded twice.
  std::map<std::string, std::string> seen;  // real path -> the name it came as
  for (const std::string& f : files) {
    char* real = ::realpath(f.c_str(), nullptr);
    const std::string key = real ? real : f;
    std::free(real);
    const auto [it, fresh] = seen.emplace(key, f);
    if (!fresh) {
      fail("--input names ", f, " twice", it->second == f ? "" : " (also as " + it->second + ")",
           ": its text would be encoded twice; name each file once");
    }
  }
  return files;
}

// ---- ShardWriter --------------------------------------------------------------------------

ShardWriter::ShardWriter(std::string path, ShardFormat format, int64_t vocab)
    : path_(std::move(path)), format_(format), vocab_(vocab) {
  const size_t slash = path_.rfind('/');
  const std::string dir = slash == std::string::npos ? "" : path_.substr(0, slash + 1);
  const std::string name = slash == std::string::npos ? path_ : path_.substr(slash + 1);
  tmp_path_ = dir + "." + name + ".tmp." + std::to_string(::getpid());
  fd_ = ::open(tmp_path_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd_ < 0) fail("cannot create ", tmp_path_, ": ", errno_text());
  buffer_.assign(kHeaderInts * 4, 0);  // the header, filled in by commit()
}

ShardWriter::~ShardWriter() {
  if (fd_ >= 0) {
    ::close(fd_);
    ::unlink(tmp_path_.c_str());
  }
}

void ShardWriter::append(const int* tokens, size_t count) {
  const int width = format_.token_bytes;
  const size_t at = buffer_.size();
  buffer_.resize(at + count * static_cast<size_t>(width));
  for (size_t i = 0; i < count; ++i) {
    const int t = tokens[i];
    if (t < 0 || t >= vocab_) {
      fail("the tokenizer returned the id ", t, ", outside its vocabulary [0, ", vocab_, ")");
    }
    put_le(buffer_.data() + at + i * width, static_cast<uint32_t>(t), width);
  }
  tokens_ += static_cast<int64_t>(count);
  if (tokens_ > INT32_MAX) fail(path_, ": more than 2^31 - 1 tokens do not fit llm.c's header");
  if (buffer_.size() >= (size_t{1} << 20)) flush();
}

void ShardWriter::flush() {
  write_all(fd_, buffer_.data(), buffer_.size(), tmp_path_);
  buffer_.clear();
}

void ShardWriter::commit() {
  if (fd_ < 0) fail(path_, " was committed already");
  flush();
  unsigned char header[kHeaderInts * 4] = {};
  put_le(header, static_cast<uint32_t>(format_.magic), 4);
  put_le(header + 4, static_cast<uint32_t>(format_.version), 4);
  put_le(header + 8, static_cast<uint32_t>(tokens_), 4);
  if (::pwrite(fd_, header, sizeof(header), 0) != static_cast<ssize_t>(sizeof(header))) {
    fail("cannot write the header of ", tmp_path_, ": ", errno_text());
  }
  if (::fsync(fd_) != 0) fail("cannot fsync ", tmp_path_, ": ", errno_text());
  const int rc = ::close(fd_);
  fd_ = -1;
  if (rc != 0) {
    ::unlink(tmp_path_.c_str());
    fail("cannot close ", tmp_path_, ": ", errno_text());
  }
  try {
    publish(tmp_path_, path_);
  } catch (...) {
    ::unlink(tmp_path_.c_str());
    throw;
  }
  fsync_directory(parent_of(path_));
}

// ---- documents ----------------------------------------------------------------------------
namespace {

struct Document {
  std::string text;
  size_t file = 0;   // index into the file list
  int64_t line = 0;  // 1-based in kLines and kJsonl mode, 0 in kFile mode
  int64_t span = 0;  // stored input bytes it accounts for (the progress line)
};

// The offset of the first byte that is not part of well-formed UTF-8 (RFC 3629: no overlong
// forms, no surrogates, nothing above U+10FFFF), or npos.
size_t first_invalid_utf8(const std::string& s) {
  const auto* b = reinterpret_cast<const unsigned char*>(s.data());
  const size_t n = s.size();
  size_t i = 0;
  while (i < n) {
    const unsigned c = b[i];
    if (c < 0x80) {
      ++i;
      continue;
    }
    size_t len = 0;
    unsigned lo = 0x80, hi = 0xBF;  // the second byte's range
    if (c >= 0xC2 && c <= 0xDF) {
      len = 2;
    } else if (c >= 0xE0 && c <= 0xEF) {
      len = 3;
      if (c == 0xE0) lo = 0xA0;
      if (c == 0xED) hi = 0x9F;
    } else if (c >= 0xF0 && c <= 0xF4) {
      len = 4;
      if (c == 0xF0) lo = 0x90;
      if (c == 0xF4) hi = 0x8F;
    } else {
      return i;
    }
    if (i + len > n || b[i + 1] < lo || b[i + 1] > hi) return i;
    for (size_t k = 2; k < len; ++k) {
      if (b[i + k] < 0x80 || b[i + k] > 0xBF) return i;
    }
    i += len;
  }
  return std::string::npos;
}

[[noreturn]] void not_utf8(const std::string& path, int64_t offset, unsigned char byte) {
  char hex[8];
  std::snprintf(hex, sizeof hex, "0x%02X", byte);
  fail("--input: ", path, " is not UTF-8 text: byte ", hex, " at offset ", offset, " begins no valid UTF-8 sequence "
       "(a Latin-1 or Windows-1252 file?), and the tokenizer would make its characters unknown pieces; convert it "
       "first, e.g. iconv -f latin1 -t utf-8");
}

[[noreturn]] void binary_file(const std::string& path, int64_t offset) {
  fail("--input: ", path, " holds a NUL byte at offset ", offset,
       ": it is a binary file, not UTF-8 text; remove it from --input");
}

// The document of one JSON Lines record: the string under `field`.
std::string jsonl_text(const std::string& line, const std::string& field, const std::string& where) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(line);
  } catch (const nlohmann::json::exception& e) {
    fail("--input: ", where, " is not a JSON object (", e.what(), "); --documents=jsonl reads one JSON object per "
         "line (JSON Lines)");
  }
  if (!j.is_object()) fail("--input: ", where, " holds JSON ", j.type_name(), ", not an object; --documents=jsonl "
                           "reads one JSON object per line");
  const auto it = j.find(field);
  if (it == j.end()) {
    std::string keys;
    for (const auto& [key, value] : j.items()) keys += (keys.empty() ? "" : ", ") + key;
    fail("--input: ", where, " has no field \"", field, "\" (its fields: ", keys.empty() ? "none" : keys,
         "); name the text's field with --jsonl_field");
  }
  if (!it->is_string()) {
    fail("--input: ", where, ": field \"", field, "\" holds JSON ", it->type_name(), ", not a string of text; name "
         "the text's field with --jsonl_field");
  }
  return it->get<std::string>();
}

// The documents of the files, in order, a batch of about batch_bytes at a time.
class DocumentSource {
 public:
  DocumentSource(const std::vector<std::string>& files, DocumentMode mode, std::string jsonl_field,
                 int64_t batch_bytes)
      : files_(files), mode_(mode), field_(std::move(jsonl_field)), batch_bytes_(std::max<int64_t>(batch_bytes, 1)) {}

  // Fills `docs` with the next batch; false when every file has been read.
  bool next_batch(std::vector<Document>& docs) {
    docs.clear();
    int64_t bytes = 0;
    while (bytes < batch_bytes_ && next(docs)) bytes += static_cast<int64_t>(docs.back().text.size()) + 1;
    text_bytes_ += bytes - static_cast<int64_t>(docs.size());
    return !docs.empty();
  }
  int64_t text_bytes() const { return text_bytes_; }

 private:
  bool next(std::vector<Document>& docs) {
    if (mode_ == DocumentMode::kFile) {
      if (file_ >= files_.size()) return false;
      TextStream in(files_[file_]);
      std::string text = in.read_all();
      const size_t nul = text.find('\0');
      if (nul != std::string::npos) binary_file(files_[file_], static_cast<int64_t>(nul));
      const size_t bad = first_invalid_utf8(text);
      if (bad != std::string::npos) not_utf8(files_[file_], static_cast<int64_t>(bad), text[bad]);
      docs.push_back({std::move(text), file_, 0, in.consumed()});
      ++file_;
      return true;
    }
    std::string line;
    while (file_ < files_.size()) {
      if (!in_) open_lines();
      if (read_line(line)) {
        if (mode_ == DocumentMode::kJsonl) {
          line = jsonl_text(line, field_, files_[file_] + ":" + std::to_string(line_));
        }
        docs.push_back({std::move(line), file_, line_, in_->consumed() - emitted_});
        emitted_ = in_->consumed();
        return true;
      }
    }
    return false;
  }

  void open_lines() {
    in_ = std::make_unique<TextStream>(files_[file_]);
    offset_ = 0;
    emitted_ = 0;
    line_ = 0;
  }

  // The next non-empty line of the open file; false (and on to the next file) at its end.
  bool read_line(std::string& line) {
    while (in_->getline(line)) {
      ++line_;
      const size_t nul = line.find('\0');
      if (nul != std::string::npos) binary_file(files_[file_], offset_ + static_cast<int64_t>(nul));
      const size_t bad = first_invalid_utf8(line);
      if (bad != std::string::npos) not_utf8(files_[file_], offset_ + static_cast<int64_t>(bad), line[bad]);
      offset_ += static_cast<int64_t>(line.size()) + 1;
      if (!line.empty() && line.back() == '\r') line.pop_back();
      if (!line.empty()) return true;
    }
    in_.reset();
    ++file_;
    return false;
  }

  const std::vector<std::string>& files_;
  DocumentMode mode_;
  std::string field_;
  int64_t batch_bytes_;
  size_t file_ = 0;
  std::unique_ptr<TextStream> in_;
  int64_t offset_ = 0;   // text bytes of the open file read so far (a NUL's offset)
  int64_t emitted_ = 0;  // the stored bytes read at the last document
  int64_t line_ = 0;
  int64_t text_bytes_ = 0;
};

std::string where(const Document& doc, const std::vector<std::string>& files) {
  std::string w = files[doc.file];
  if (doc.line > 0) w += ":" + std::to_string(doc.line);
  return w;
}

int64_t total_size(const std::vector<std::string>& files) {
  int64_t total = 0;
  for (const std::string& f : files) {
    struct stat st;
    if (stat_path(f, &st)) total += static_cast<int64_t>(st.st_size);
  }
  return total;
}

// The progress line (prepare.h): counters the encoding threads add to, and a thread that draws
// them every 200 ms. Inactive (counting only) without a stream.
class ProgressMeter {
 public:
  ProgressMeter(std::FILE* out, int64_t total_bytes, int specials_per_document)
      : out_(out), total_bytes_(total_bytes), specials_(specials_per_document) {
    if (out_) thread_ = std::thread([this] { run(); });
  }
  ~ProgressMeter() { stop(false); }
  ProgressMeter(const ProgressMeter&) = delete;
  ProgressMeter& operator=(const ProgressMeter&) = delete;

  // One document encoded to `tokens` tokens (before BOS/EOS), from any thread.
  void document_done(int64_t span, size_t tokens) {
    bytes_.fetch_add(span, std::memory_order_relaxed);
    if (tokens == 0) return;
    documents_.fetch_add(1, std::memory_order_relaxed);
    tokens_.fetch_add(static_cast<int64_t>(tokens) + specials_, std::memory_order_relaxed);
  }

  // Runs fn (which logs a line) with the progress line cleared; the next tick draws it again
  // (so a run of many small shards does not redraw it more often).
  template <typename Fn>
  void quiet(Fn&& fn) {
    if (!out_) return fn();
    std::lock_guard<std::mutex> lock(mutex_);
    if (width_ > 0 && !stopping_) {
      std::fprintf(out_, "\r%s\r", std::string(width_, ' ').c_str());
      std::fflush(out_);
    }
    fn();
  }

  // Draws the last state, 100%, and ends the line.
  void finish() { stop(true); }

 private:
  void run() {
    std::unique_lock<std::mutex> lock(mutex_);
    while (!stopping_) {
      draw(false);
      wake_.wait_for(lock, std::chrono::milliseconds(200), [this] { return stopping_; });
    }
  }

  void stop(bool success) {
    if (!out_) return;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (stopping_) return;
      stopping_ = true;
    }
    wake_.notify_all();
    thread_.join();
    std::lock_guard<std::mutex> lock(mutex_);
    draw(success);
    std::fputc('\n', out_);
    std::fflush(out_);
  }

  // With mutex_ held: "\r" and the line, padded over a longer one drawn before.
  void draw(bool done) {
    ProgressSnapshot p;
    p.total_bytes = total_bytes_;
    p.bytes = done ? total_bytes_ : bytes_.load(std::memory_order_relaxed);
    p.documents = documents_.load(std::memory_order_relaxed);
    p.tokens = tokens_.load(std::memory_order_relaxed);
    p.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
    p.done = done;
    std::string line = format_progress(p);
    const size_t width = line.size();
    if (width < width_) line.append(width_ - width, ' ');
    width_ = std::max(width_, width);
    std::fprintf(out_, "\r%s", line.c_str());
    std::fflush(out_);
  }

  std::FILE* out_;
  int64_t total_bytes_;
  int64_t specials_;
  const std::chrono::steady_clock::time_point start_ = std::chrono::steady_clock::now();
  std::atomic<int64_t> bytes_{0}, documents_{0}, tokens_{0};
  std::mutex mutex_;
  std::condition_variable wake_;
  bool stopping_ = false;
  size_t width_ = 0;  // the widest line drawn
  std::thread thread_;
};

// Encodes the batch on up to `threads` threads; tokens[i] belongs to docs[i].
void encode_batch(const Encoder& encoder, const std::vector<Document>& docs, const std::vector<std::string>& files,
                  int threads, ProgressMeter& meter, std::vector<std::vector<int>>& tokens) {
  tokens.assign(docs.size(), {});
  std::atomic<size_t> next{0};
  std::vector<std::exception_ptr> errors(static_cast<size_t>(std::max(threads, 1)));
  auto work = [&](size_t slot) {
    size_t i = 0;
    try {
      for (i = next++; i < docs.size(); i = next++) {
        tokens[i] = encoder.encode(docs[i].text);
        meter.document_done(docs[i].span, tokens[i].size());
      }
    } catch (const std::exception& e) {
      errors[slot] = std::make_exception_ptr(
          PrepareError("encoding the document of " + where(docs[i], files) + ": " + e.what()));
    }
  };
  const size_t n = std::min(errors.size(), docs.size());
  std::vector<std::thread> pool;
  for (size_t t = 1; t < n; ++t) pool.emplace_back(work, t);
  work(0);
  for (std::thread& t : pool) t.join();
  for (const std::exception_ptr& e : errors) {
    if (e) std::rethrow_exception(e);
  }
}

// The token stream -> val shard, then train shards of shard_tokens each (prepare.h).
class ShardSink {
 public:
  ShardSink(const PrepareOptions& options, ShardFormat format, int64_t vocab, ProgressMeter& meter)
      : options_(options), format_(format), vocab_(vocab), meter_(meter), index_(options.val_tokens > 0 ? 0 : 1) {}

  // Removes every shard this sink finished unless it was finished (an error on the way).
  ~ShardSink() {
    if (finished_) return;
    current_.reset();  // removes its temporary file
    for (const ShardInfo& s : done_) ::unlink(s.path.c_str());
  }

  void append(const int* tokens, size_t n) {
    while (n > 0) {
      if (!current_) open_next();
      const int64_t room = limit() - current_->tokens();
      const size_t take = std::min(n, static_cast<size_t>(room));
      current_->append(tokens, take);
      tokens += take;
      n -= take;
      if (current_->tokens() == limit()) close_current();
    }
  }

  const std::vector<ShardInfo>& finish() {
    if (current_) close_current();
    finished_ = true;
    return done_;
  }
  size_t finished_shards() const { return done_.size(); }

 private:
  int64_t limit() const { return index_ == 0 ? options_.val_tokens : options_.shard_tokens; }

  void open_next() {
    const std::string path = options_.output_dir + "/" + shard_name(options_.prefix, index_ == 0, index_);
    current_ = std::make_unique<ShardWriter>(path, format_, vocab_);
  }

  void close_current() {
    current_->commit();
    done_.push_back({current_->path(), current_->tokens()});
    meter_.quiet([&] {
      LOG(INFO) << "dtrain-prepare: wrote " << current_->path() << " (" << current_->tokens() << " tokens)";
    });
    current_.reset();
    ++index_;
  }

  const PrepareOptions& options_;
  ShardFormat format_;
  int64_t vocab_;
  ProgressMeter& meter_;
  int64_t index_;
  std::unique_ptr<ShardWriter> current_;
  std::vector<ShardInfo> done_;
  bool finished_ = false;
};

void check_options(const PrepareOptions& o) {
  if (o.shard_tokens < 1 || o.shard_tokens > INT32_MAX) {
    fail("--shard_tokens=", o.shard_tokens, ": give 1 .. 2147483647 (llm.c's header holds the count as an int32)");
  }
  if (o.val_tokens < 0 || o.val_tokens > INT32_MAX) {
    fail("--val_tokens=", o.val_tokens, ": give 0 (no validation shard) .. 2147483647");
  }
  if (o.prefix.empty() || o.prefix.find('/') != std::string::npos) {
    fail("--prefix='", o.prefix, "': give a file-name prefix without '/' (e.g. --prefix=corpus)");
  }
  if (o.threads < 1) fail("threads=", o.threads, ": give at least 1");
  if (o.documents == DocumentMode::kJsonl && o.jsonl_field.empty()) {
    fail("--jsonl_field is empty: name the field that holds each record's text");
  }
  if (o.output_dir.empty()) fail("--output_dir is empty: name an existing directory for the shards");
  struct stat st;
  if (!stat_path(o.output_dir, &st)) {
    fail("--output_dir=", o.output_dir, " does not exist: create it first (mkdir -p ", o.output_dir, ")");
  }
  if (!S_ISDIR(st.st_mode)) fail("--output_dir=", o.output_dir, " is not a directory");
  std::vector<std::string> clash;
  for (const std::string& name : directory_names(o.output_dir)) {
    const bool ours = name.rfind(o.prefix + "_val_", 0) == 0 || name.rfind(o.prefix + "_train_", 0) == 0;
    if (ours && name.size() > 4 && name.compare(name.size() - 4, 4, ".bin") == 0) clash.push_back(name);
  }
  if (!clash.empty()) {
    std::string names = clash[0];
    for (size_t i = 1; i < clash.size() && i < 3; ++i) names += ", " + clash[i];
    if (clash.size() > 3) names += ", ... (" + std::to_string(clash.size()) + " in all)";
    fail("--output_dir=", o.output_dir, " already holds shards of --prefix=", o.prefix, " (", names,
         "): remove them, or choose another --prefix or --output_dir (dtrain-prepare never overwrites shards)");
  }
}

int64_t special_id(const Encoder& encoder, bool bos) {
  const int64_t id = bos ? encoder.bos_id() : encoder.eos_id();
  const char* what = bos ? "BOS" : "EOS";
  if (id < 0) {
    fail("--", bos ? "bos" : "eos", "=true: the tokenizer (", encoder.describe(), ") defines no ", what,
         " id; pass --", bos ? "bos" : "eos", "=false");
  }
  if (id >= encoder.vocab_size()) fail("the tokenizer's ", what, " id ", id, " is outside its vocabulary of ", encoder.vocab_size());
  return id;
}

}  // namespace

PrepareSummary prepare_shards(const PrepareOptions& options, const Encoder& encoder) {
  const auto start = std::chrono::steady_clock::now();
  check_options(options);
  PrepareSummary summary;
  summary.vocab = encoder.vocab_size();
  summary.format = shard_format_for_vocab(summary.vocab);
  const int bos = options.bos ? static_cast<int>(special_id(encoder, true)) : -1;
  const int eos = options.eos ? static_cast<int>(special_id(encoder, false)) : -1;
  const std::vector<std::string> files = expand_inputs(options.inputs);
  summary.files = static_cast<int64_t>(files.size());
  ProgressMeter meter(options.progress_to, total_size(files), (bos >= 0) + (eos >= 0));
  ShardSink sink(options, summary.format, summary.vocab, meter);
  try {
    DocumentSource source(files, options.documents, options.jsonl_field, options.batch_bytes);
    std::vector<Document> docs;
    std::vector<std::vector<int>> tokens;
    while (source.next_batch(docs)) {
      encode_batch(encoder, docs, files, options.threads, meter, tokens);
      for (const std::vector<int>& t : tokens) {
        if (t.empty()) {
          ++summary.skipped_documents;
          continue;
        }
        ++summary.documents;
        if (bos >= 0) sink.append(&bos, 1);
        sink.append(t.data(), t.size());
        if (eos >= 0) sink.append(&eos, 1);
        summary.tokens += static_cast<int64_t>(t.size()) + (bos >= 0) + (eos >= 0);
      }
    }
    summary.text_bytes = source.text_bytes();
    if (summary.tokens == 0) {
      fail("--input: the ", files.size(), " file(s) hold no text: every document encoded to no tokens");
    }
    summary.shards = sink.finish();
    meter.finish();
  } catch (const PrepareError& e) {
    const size_t n = sink.finished_shards();
    if (n == 0) throw;
    throw PrepareError(std::string(e.what()) + " (the " + std::to_string(n) +
                       " shard(s) this run had written were removed)");
  }
  summary.val_tokens = std::min(summary.tokens, options.val_tokens);
  summary.train_tokens = summary.tokens - summary.val_tokens;
  summary.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return summary;
}

std::string PrepareSummary::line(const std::string& output_dir) const {
  const int64_t train_shards = static_cast<int64_t>(shards.size()) - (val_tokens > 0 ? 1 : 0);
  std::ostringstream os;
  os << "dtrain-prepare: " << files << " files, " << documents << " documents";
  if (skipped_documents > 0) os << " (" << skipped_documents << " empty skipped)";
  os << ", " << tokens << " tokens (" << (format.token_bytes == 2 ? "uint16" : "uint32") << ", vocab " << vocab
     << ") in " << shards.size() << " shards under " << output_dir << " (val " << val_tokens << " tokens; train "
     << train_shards << " shards, " << train_tokens << " tokens), ";
  char rate[96];
  std::snprintf(rate, sizeof(rate), "%.2f s, %.0f tokens/s", seconds,
                static_cast<double>(tokens) / std::max(seconds, 1e-9));
  os << rate;
  return os.str();
}

}  // namespace dtrain::prepare
