// One input file of dtrain-prepare as text, decompressed by its name: NAME.gz is gzip (zlib; a
// file of several gzip members reads as their concatenation, as gzip -d does), NAME.zst is
// zstd (one or more frames), any other name is read as stored. Plain C++17 with zlib and
// libzstd; no libtorch.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

namespace dtrain::prepare {

enum class Compression { kNone, kGzip, kZstd };
// By the file name's suffix (.gz, .zst).
Compression compression_of(const std::string& path);
const char* compression_name(Compression c);  // "gzip", "zstd", "none"
// Whether this build reads .zst files (it was built with libzstd).
bool zstd_supported();

class TextStream {
 public:
  // Opens the file; PrepareError (naming --input and the file) when it cannot.
  explicit TextStream(const std::string& path);
  ~TextStream();
  TextStream(const TextStream&) = delete;
  TextStream& operator=(const TextStream&) = delete;

  // The next line without its '\n' (a '\r' before it is kept); false at the end of the file (a
  // last line without '\n' is a line). PrepareError for a read error and for compressed data
  // that is corrupt or cut short, naming the file.
  bool getline(std::string& line);
  // The rest of the file (decompressed).
  std::string read_all();
  // Bytes of the file as stored (compressed bytes for .gz and .zst) read so far: the progress
  // line's measure, which ends at the file's size.
  int64_t consumed() const { return consumed_; }
  Compression compression() const { return compression_; }

 private:
  bool fill();  // decodes more into out_; false at the end of the file
  struct Decoder;
  std::string path_;
  Compression compression_;
  int fd_ = -1;
  std::unique_ptr<Decoder> decoder_;
  std::string in_;       // stored bytes read and not yet decoded
  size_t in_pos_ = 0;
  std::string out_;      // decoded bytes not yet handed out
  size_t out_pos_ = 0;
  bool eof_ = false;     // the file is read to its end
  bool done_ = false;    // and everything decoded
  int64_t consumed_ = 0;
};

}  // namespace dtrain::prepare
