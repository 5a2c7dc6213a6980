#include "datasets.h"

#include <zlib.h>

#include <algorithm>
#include <cstring>
#include <dirent.h>
#include <sys/stat.h>
#include <fstream>
#include <sstream>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include "dtrain/dist/error.h"

namespace dtrain::examples {

std::pair<at::Tensor, at::Tensor> load_digits(const std::string& path) {
  gzFile f = gzopen(path.c_str(), "rb");
  DTRAIN_CHECK(f != nullptr, "cannot open the digits data '", path,
               "'; run bash cluster/setup.sh (installs scikit-learn) or pass --data=synthetic");
  std::string text;
  char buf[1 << 16];
  int n;
  while ((n = gzread(f, buf, sizeof(buf))) > 0) text.append(buf, n);
  gzclose(f);
  std::vector<float> pixels;
  std::vector<int64_t> labels;
  std::istringstream lines(text);
  std::string line;
  int64_t row = 0;
  while (std::getline(lines, line)) {
    if (line.empty()) continue;
    ++row;
    std::vector<double> values;
    std::istringstream cells(line);
    std::string cell;
    while (std::getline(cells, cell, ',')) values.push_back(std::stod(cell));
    DTRAIN_CHECK(values.size() == 65, path, ":", row, ": expected 65 values, found ", values.size());
    for (int i = 0; i < 64; ++i) pixels.push_back(static_cast<float>(values[i] / 16.0));
    labels.push_back(static_cast<int64_t>(values[64]));
  }
  DTRAIN_CHECK(row > 0, "no rows in ", path);
  at::Tensor x = at::tensor(pixels).view({row, 64});
  at::Tensor y = at::tensor(labels);
  return {x, y};
}

namespace {

// Why `bytes` (the start of a file) is not text, or "" when it is: NUL bytes or malformed UTF-8
// mean a binary file (a token shard, an executable, a compressed archive), whose bytes a byte
// language model would learn as if they were characters.
std::string not_text(const std::string& bytes) {
  size_t i = 0;
  while (i < bytes.size()) {
    const auto c = static_cast<unsigned char>(bytes[i]);
    if (c == 0) return "byte " + std::to_string(i) + " is 0x00";
    int more = c < 0x80 ? 0 : (c >> 5) == 0x6 ? 1 : (c >> 4) == 0xE ? 2 : (c >> 3) == 0x1E ? 3 : -1;
    if (more < 0) return "byte " + std::to_string(i) + " (0x" + "0123456789abcdef"[c >> 4] + "0123456789abcdef"[c & 15] +
                         ") does not begin a UTF-8 character";
    if (i + more >= bytes.size()) break;  // a character cut by the sample's end
    for (int k = 1; k <= more; ++k) {
      if ((static_cast<unsigned char>(bytes[i + k]) >> 6) != 0x2) {
        return "bytes " + std::to_string(i) + "-" + std::to_string(i + k) + " are not a UTF-8 character";
      }
    }
    i += more + 1;
  }
  return "";
}

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  DTRAIN_CHECK(in.good(), "cannot read '", path, "'; pass --data_path=FILE_OR_DIR or --data=synthetic");
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

}  // namespace

at::Tensor load_text_bytes(const std::string& path) {
  // POSIX rather than std::filesystem (see examples/common.cc).
  struct stat top {};
  DTRAIN_CHECK(stat(path.c_str(), &top) == 0, "the text corpus '", path, "' does not exist; pass --data_path=FILE or ",
               "DIR (text files) or --data=synthetic");
  std::vector<std::string> files;
  if (S_ISDIR(top.st_mode)) {
    DIR* d = opendir(path.c_str());
    DTRAIN_CHECK(d != nullptr, "the text corpus directory '", path, "' cannot be read; pass --data_path=FILE or DIR ",
                 "or --data=synthetic");
    while (dirent* e = readdir(d)) {
      std::string file = path + "/" + e->d_name;
      struct stat st {};
      if (stat(file.c_str(), &st) == 0 && S_ISREG(st.st_mode)) files.push_back(file);
    }
    closedir(d);
    std::sort(files.begin(), files.end());
  } else {
    files.push_back(path);
  }
  std::string all;
  for (const std::string& file : files) {
    const std::string text = read_file(file);
    const std::string why = not_text(text.substr(0, 1 << 20));
    DTRAIN_CHECK(why.empty(), "'", file, "' is not text (", why, "): the example language models train on UTF-8 ",
                 "text, one token per byte, and would learn a binary file's bytes (a token shard, an executable, an ",
                 "archive) as if they were characters. Pass text with --data_path (a file, or a directory of text ",
                 "files), or --data=synthetic");
    all += text;
  }
  DTRAIN_CHECK(!all.empty(), "no text found in '", path, "'");
  at::Tensor t = at::empty({static_cast<int64_t>(all.size())}, at::kByte);
  std::memcpy(t.data_ptr(), all.data(), all.size());
  return t;
}

TokenWindows::TokenWindows(at::Tensor tokens, int64_t len, int64_t stride)
    : tokens_(tokens.to(at::kLong).contiguous()), len_(len), stride_(stride) {
  DTRAIN_CHECK(len >= 1 && stride >= 1, "window length and stride must be positive");
  DTRAIN_CHECK(tokens_.numel() >= len + 1, "the corpus has ", tokens_.numel(),
               " tokens, fewer than one window of ", len + 1, "; lower --seq_len");
}

int64_t TokenWindows::size() const { return (tokens_.numel() - len_ - 1) / stride_ + 1; }

std::vector<at::Tensor> TokenWindows::get_batch(const std::vector<int64_t>& indices) const {
  at::Tensor out = at::empty({static_cast<int64_t>(indices.size()), len_ + 1}, at::kLong);
  for (size_t k = 0; k < indices.size(); ++k) {
    out[k].copy_(tokens_.narrow(0, indices[k] * stride_, len_ + 1));
  }
  return {out};
}

std::shared_ptr<engine::Dataset> synthetic_tokens(int64_t count, int64_t len, int64_t vocab, uint64_t seed) {
  auto g = at::make_generator<at::CPUGeneratorImpl>(seed);
  at::Tensor t = at::randint(vocab, {count, len + 1}, g, at::kLong);
  return std::make_shared<engine::TensorDataset>(std::vector<at::Tensor>{t});
}

std::pair<at::Tensor, at::Tensor> synthetic_classification(int64_t count, int64_t features,
                                                           int64_t classes, uint64_t seed) {
  auto g = at::make_generator<at::CPUGeneratorImpl>(seed);
  at::Tensor x = at::randn({count, features}, g, at::kFloat);
  at::Tensor w = at::randn({features, classes}, g, at::kFloat);
  at::Tensor y = at::argmax(at::matmul(x, w), 1);
  return {x, y};
}

}  // namespace dtrain::examples
