// TextStream (text_stream.h): POSIX reads of 1 MiB, zlib's inflate for gzip, libzstd's streaming
// decompression for zstd.
#include "text_stream.h"

#include <fcntl.h>
#include <unistd.h>
#include <zlib.h>
#if DTRAIN_PREPARE_ZSTD
#include <zstd.h>
#endif

#include <cerrno>
#include <cstring>

#include "prepare.h"

namespace dtrain::prepare {
namespace {

constexpr size_t kChunk = size_t{1} << 20;

bool ends_with(const std::string& s, const char* suffix) {
  const size_t n = std::strlen(suffix);
  return s.size() >= n && s.compare(s.size() - n, n, suffix) == 0;
}

}  // namespace

Compression compression_of(const std::string& path) {
  if (ends_with(path, ".gz")) return Compression::kGzip;
  if (ends_with(path, ".zst")) return Compression::kZstd;
  return Compression::kNone;
}

bool zstd_supported() {
#if DTRAIN_PREPARE_ZSTD
  return true;
#else
  return false;
#endif
}

const char* compression_name(Compression c) {
  return c == Compression::kGzip ? "gzip" : c == Compression::kZstd ? "zstd" : "none";
}

// The decompressor of one stream: decode() turns stored bytes into text, finish() says whether
// the stream ended where a member or frame ends.
struct TextStream::Decoder {
  explicit Decoder(Compression c, const std::string& path) : kind(c), path(path) {
    if (kind == Compression::kGzip) {
      std::memset(&z, 0, sizeof(z));
      if (inflateInit2(&z, 15 + 32) != Z_OK) throw PrepareError("--input: " + path + ": zlib failed to start");
    } else if (kind == Compression::kZstd) {
#if DTRAIN_PREPARE_ZSTD
      zstd = ZSTD_createDStream();
      if (zstd == nullptr || ZSTD_isError(ZSTD_initDStream(zstd))) {
        throw PrepareError("--input: " + path + ": zstd failed to start");
      }
#else
      throw PrepareError("--input: " + path + " is zstd-compressed (.zst), and this dtrain-prepare was built without "
                         "libzstd: install libzstd-dev (bash cluster/setup.sh) and build again, or decompress it "
                         "first (zstd -d)");
#endif
    }
  }
  ~Decoder() {
    if (kind == Compression::kGzip) inflateEnd(&z);
#if DTRAIN_PREPARE_ZSTD
    if (zstd != nullptr) ZSTD_freeDStream(zstd);
#endif
  }
  Decoder(const Decoder&) = delete;
  Decoder& operator=(const Decoder&) = delete;

  // Decodes in[*pos..] into out (appending), advancing *pos past what was used.
  void decode(const std::string& in, size_t* pos, std::string& out) {
    char buf[1 << 16];
    if (kind == Compression::kGzip) {
      while (*pos < in.size()) {
        if (member_done) {  // another gzip member follows the one that ended
          if (inflateReset(&z) != Z_OK) throw PrepareError("--input: " + path + ": zlib failed to restart");
          member_done = false;
        }
        z.next_in = reinterpret_cast<Bytef*>(const_cast<char*>(in.data() + *pos));
        z.avail_in = static_cast<uInt>(in.size() - *pos);
        z.next_out = reinterpret_cast<Bytef*>(buf);
        z.avail_out = sizeof(buf);
        const int rc = inflate(&z, Z_NO_FLUSH);
        *pos = in.size() - z.avail_in;
        out.append(buf, sizeof(buf) - z.avail_out);
        if (rc == Z_STREAM_END) {
          member_done = true;
        } else if (rc != Z_OK && rc != Z_BUF_ERROR) {
          throw PrepareError("--input: " + path + " is not valid gzip data (zlib: " + (z.msg ? z.msg : "error " +
                             std::to_string(rc)) + "); a .gz name means gzip: rename the file if it is plain text");
        }
      }
      started = true;
      return;
    }
#if DTRAIN_PREPARE_ZSTD
    while (*pos < in.size()) {
      ZSTD_inBuffer input{in.data() + *pos, in.size() - *pos, 0};
      ZSTD_outBuffer output{buf, sizeof(buf), 0};
      const size_t rc = ZSTD_decompressStream(zstd, &output, &input);
      if (ZSTD_isError(rc)) {
        throw PrepareError("--input: " + path + " is not valid zstd data (zstd: " + ZSTD_getErrorName(rc) +
                           "); a .zst name means zstd: rename the file if it is plain text");
      }
      *pos += input.pos;
      out.append(buf, output.pos);
      frame_left = rc;  // 0: a frame ended here
    }
#endif
    started = true;
  }

  // At the end of the file: the last member or frame must have ended.
  void finish() const {
    const bool cut = kind == Compression::kGzip ? started && !member_done : frame_left != 0;
    if (cut) {
      throw PrepareError("--input: " + path + " ends in the middle of its " + compression_name(kind) +
                         " stream: the file is cut short (an interrupted download?)");
    }
  }

  Compression kind;
  std::string path;
  z_stream z{};
  bool member_done = false, started = false;
#if DTRAIN_PREPARE_ZSTD
  ZSTD_DStream* zstd = nullptr;
#endif
  size_t frame_left = 0;
};

TextStream::TextStream(const std::string& path) : path_(path), compression_(compression_of(path)) {
  fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd_ < 0) throw PrepareError("--input: cannot open " + path + ": " + std::strerror(errno));
  if (compression_ != Compression::kNone) decoder_ = std::make_unique<Decoder>(compression_, path);
}

TextStream::~TextStream() {
  if (fd_ >= 0) ::close(fd_);
}

bool TextStream::fill() {
  if (done_) return false;
  // Drop what was handed out.
  out_.erase(0, out_pos_);
  out_pos_ = 0;
  const size_t before = out_.size();
  while (out_.size() == before && !done_) {
    if (!eof_ && in_pos_ >= in_.size()) {
      in_.resize(kChunk);
      ssize_t n;
      do {
        n = ::read(fd_, in_.data(), kChunk);
      } while (n < 0 && errno == EINTR);
      if (n < 0) throw PrepareError("--input: cannot read " + path_ + ": " + std::strerror(errno));
      in_.resize(static_cast<size_t>(n));
      in_pos_ = 0;
      consumed_ += n;
      eof_ = n == 0;
    }
    if (decoder_) {
      decoder_->decode(in_, &in_pos_, out_);
    } else {
      out_.append(in_, in_pos_, std::string::npos);
      in_pos_ = in_.size();
    }
    if (eof_ && in_pos_ >= in_.size()) {
      if (decoder_) decoder_->finish();
      done_ = true;
    }
  }
  return out_.size() > before;
}

bool TextStream::getline(std::string& line) {
  size_t from = out_pos_;
  for (;;) {
    const size_t nl = out_.find('\n', from);
    if (nl != std::string::npos) {
      line.assign(out_, out_pos_, nl - out_pos_);
      out_pos_ = nl + 1;
      return true;
    }
    const size_t scanned = out_.size() - out_pos_;  // fill() moves the unread bytes to the front
    if (!fill()) {
      if (out_pos_ >= out_.size()) return false;
      line.assign(out_, out_pos_, std::string::npos);  // a last line without '\n'
      out_pos_ = out_.size();
      return true;
    }
    from = out_pos_ + scanned;
  }
}

std::string TextStream::read_all() {
  while (fill()) {
  }
  std::string rest = out_.substr(out_pos_);
  out_pos_ = out_.size();
  return rest;
}

}  // namespace dtrain::prepare
