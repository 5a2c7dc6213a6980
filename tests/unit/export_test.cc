// Export formats: a traced TorchScript archive of a C++ module, loaded back with
// torch::jit::load, against the module's own forward; safetensors files against the bytes
// written (every dtype, scalars, empty tensors, alignment, metadata); bad paths refused with
// nothing left behind.
#include "dtrain/engine/state/export.h"

#include <gtest/gtest.h>

#include <dirent.h>
#include <sys/stat.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <torch/csrc/jit/serialization/import.h>
#include <torch/torch.h>

#include "dtrain/dist/error.h"
#include "test_util.h"

namespace dtrain::engine {
namespace {

using testing_util::error_of;


std::vector<std::string> entries(const std::string& dir) {
  std::vector<std::string> out;
  if (DIR* d = ::opendir(dir.c_str())) {
    while (dirent* e = ::readdir(d)) {
      const std::string name = e->d_name;
      if (name != "." && name != "..") out.push_back(name);
    }
    ::closedir(d);
  }
  std::sort(out.begin(), out.end());
  return out;
}

// Nested modules with parameters and buffers (BatchNorm's running statistics).
struct Net : torch::nn::Module {
  Net() {
    body = register_module("body", torch::nn::Sequential(torch::nn::Linear(5, 7), torch::nn::BatchNorm1d(7),
                                                          torch::nn::Tanh(), torch::nn::Linear(7, 4)));
    head = register_module("head", torch::nn::Linear(4, 3));
  }
  at::Tensor forward(const at::Tensor& x, const at::Tensor& y) { return head->forward(body->forward(x)) * y; }
  torch::nn::Sequential body{nullptr};
  torch::nn::Linear head{nullptr};
};

TEST(Export, TracedArchiveReproducesTheModuleThroughTorchJitLoad) {
  const testing_util::ScratchDir scratch("export", true);  // removed with what the test wrote
  const std::string dir = scratch.str();
  torch::manual_seed(3);
  auto net = std::make_shared<Net>();
  // Non-trivial running statistics, then eval mode (the archive uses them).
  for (int i = 0; i < 3; ++i) net->forward(torch::randn({6, 5}), torch::ones({6, 3}));
  net->eval();
  const std::vector<at::Tensor> example = {torch::randn({6, 5}), torch::rand({6, 3})};
  auto forward = [&](const std::vector<at::Tensor>& in) { return net->forward(in[0], in[1]); };
  const std::string path = dir + "/net.pt";
  EXPECT_GT(trace_to_torchscript(*net, forward, example, "Net", path), 0);
  // Other values of the same shape: the archive computes, it did not record the output.
  const std::vector<at::Tensor> other = {torch::randn({6, 5}), torch::rand({6, 3})};
  torch::NoGradGuard no_grad;
  const at::Tensor want = net->forward(other[0], other[1]);
  EXPECT_LT((run_torchscript(path, other) - want).abs().max().item<float>(), 1e-6);
  // The archive holds the module's tensors under the module's names.
  torch::jit::Module loaded = torch::jit::load(path);
  std::map<std::string, at::Tensor> archived;
  for (const auto& p : loaded.named_parameters()) archived[p.name] = p.value;
  for (const auto& b : loaded.named_buffers()) archived[b.name] = b.value;
  for (const auto& [name, t] : module_tensors(*net)) {
    ASSERT_TRUE(archived.count(name)) << name;
    EXPECT_TRUE(at::equal(archived[name], t)) << name;
  }
  EXPECT_EQ(archived.size(), module_tensors(*net).size());
  EXPECT_EQ(entries(dir), std::vector<std::string>{"net.pt"}) << "a temporary file was left behind";
}

TEST(Export, SafetensorsHoldsEveryDtypeAndShapeExactly) {
  const testing_util::ScratchDir scratch("export", true);  // removed with what the test wrote
  const std::string dir = scratch.str();
  auto g = at::make_generator<at::CPUGeneratorImpl>(5);
  NamedTensorList tensors = {
      {"f64", at::randn({3, 2}, g, at::kDouble)},
      {"f32.transposed", at::randn({4, 3}, g, at::kFloat).t()},  // not contiguous: written in logical order
      {"f16", at::randn({5}, g, at::kFloat).to(at::kHalf)},
      {"bf16", at::randn({2, 2, 2}, g, at::kFloat).to(at::kBFloat16)},
      {"i64", at::randint(-100, 100, {3}, g, at::TensorOptions().dtype(at::kLong))},
      {"i32", at::randint(-100, 100, {1, 3}, g, at::TensorOptions().dtype(at::kInt))},
      {"i16", at::randint(-100, 100, {2}, g, at::TensorOptions().dtype(at::kShort))},
      {"i8", at::randint(-100, 100, {7}, g, at::TensorOptions().dtype(at::kChar))},
      {"u8", at::randint(0, 255, {3}, g, at::TensorOptions().dtype(at::kByte))},
      {"bool", at::randint(0, 2, {4}, g, at::TensorOptions().dtype(at::kLong)).to(at::kBool)},
      {"scalar", at::scalar_tensor(2.5, at::kFloat)},
      {"empty", at::empty({0, 3}, at::kFloat)},
  };
  const std::string path = dir + "/all.safetensors";
  save_safetensors(path, tensors, {{"format", "pt"}, {"note", "a test"}});
  const NamedTensorList back = load_safetensors(path);
  ASSERT_EQ(back.size(), tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    EXPECT_EQ(back[i].first, tensors[i].first);
    EXPECT_EQ(back[i].second.scalar_type(), tensors[i].second.scalar_type()) << tensors[i].first;
    EXPECT_TRUE(at::equal(back[i].second, tensors[i].second)) << tensors[i].first;
  }
  // The layout itself: header length, JSON header padded to 8 bytes, metadata, byte ranges.
  std::ifstream in(path, std::ios::binary);
  uint64_t n = 0;
  unsigned char raw[8];
  in.read(reinterpret_cast<char*>(raw), 8);
  for (int i = 7; i >= 0; --i) n = (n << 8) | raw[i];
  EXPECT_EQ((8 + n) % 8, 0u);
  std::string text(n, '\0');
  in.read(text.data(), static_cast<std::streamsize>(n));
  const nlohmann::json header = nlohmann::json::parse(text);
  EXPECT_EQ(header["__metadata__"]["note"], "a test");
  EXPECT_EQ(header["f64"]["dtype"], "F64");
  EXPECT_EQ(header["bf16"]["dtype"], "BF16");
  EXPECT_EQ(header["scalar"]["shape"], nlohmann::json::array());
  EXPECT_EQ(header["f64"]["data_offsets"], nlohmann::json::array({0, 48}));
  struct stat st {};
  ASSERT_EQ(::stat(path.c_str(), &st), 0);
  int64_t bytes = 0;
  for (const auto& [name, t] : tensors) bytes += static_cast<int64_t>(t.nbytes());
  EXPECT_EQ(st.st_size, static_cast<int64_t>(8 + n) + bytes) << "the data section has holes or extra bytes";
}

TEST(Export, BadPathsAndTensorsAreRefusedAndLeaveNothingBehind) {
  const testing_util::ScratchDir scratch("export", true);  // removed with what the test wrote
  const std::string dir = scratch.str();
  const NamedTensorList one = {{"w", at::ones({2})}};
  EXPECT_NE(error_of([&] { save_safetensors(dir + "/no/such/dir/w.safetensors", one); })
                .find("does not exist; create it (mkdir -p " + dir + "/no/such/dir)"),
            std::string::npos);
  EXPECT_NE(error_of([&] { save_safetensors(dir, one); }).find("is a directory"), std::string::npos);
  save_safetensors(dir + "/file", one);
  EXPECT_NE(error_of([&] { save_safetensors(dir + "/file/w.safetensors", one); }).find("is not a directory"),
            std::string::npos);
  EXPECT_NE(error_of([&] { save_safetensors(dir + "/c.safetensors", {{"c", at::ones({2}, at::kComplexFloat)}}); })
                .find("no dtype code for tensor 'c'"),
            std::string::npos);
  EXPECT_NE(error_of([&] { save_safetensors(dir + "/d.safetensors", {{"w", at::ones({1})}, {"w", at::ones({1})}}); })
                .find("the name 'w' is given twice"),
            std::string::npos);
  EXPECT_EQ(entries(dir), std::vector<std::string>{"file"});
  // A file that is not safetensors.
  {
    std::ofstream bad(dir + "/bad", std::ios::binary);
    bad << "not a safetensors file at all";
  }
  EXPECT_NE(error_of([&] { load_safetensors(dir + "/bad"); }).find("is not a safetensors file"), std::string::npos);
}

}  // namespace
}  // namespace dtrain::engine
