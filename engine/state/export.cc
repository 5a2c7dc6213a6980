#include "dtrain/engine/state/export.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cstring>
#include <fstream>
#include <iterator>
#include <set>
#include <sstream>

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>
#include <torch/csrc/jit/api/module.h>
#include <torch/csrc/jit/frontend/tracer.h>
#include <torch/csrc/jit/serialization/import.h>
#include <torch/nn/module.h>

#include "dtrain/dist/error.h"
#include "dtrain/engine/state/checkpoint.h"

namespace dtrain::engine {
namespace {

std::string parent_dir(const std::string& path) {
  const size_t slash = path.find_last_of('/');
  if (slash == std::string::npos) return ".";
  return slash == 0 ? "/" : path.substr(0, slash);
}

// Writes the bytes of `write` to a temporary file beside path, syncs it, renames it over path
// and syncs the directory; removes the temporary file on failure. The caller has run
// check_output_path(path) (before its own work, so a bad path fails early).
void write_atomically(const std::string& path, const std::function<void(WritableFile&)>& write) {
  FileSystem* fs = default_file_system();
  const std::string tmp = path + ".tmp." + std::to_string(::getpid());
  try {
    std::unique_ptr<WritableFile> file = fs->new_writable_file(tmp);
    write(*file);
    file->sync();
    file->close();
    fs->rename(tmp, path);
    fs->sync_dir(parent_dir(path));
  } catch (...) {
    ::unlink(tmp.c_str());
    throw;
  }
}

// safetensors' dtype codes.
const std::vector<std::pair<at::ScalarType, std::string>>& dtype_codes() {
  static const std::vector<std::pair<at::ScalarType, std::string>> codes = {
      {at::kDouble, "F64"}, {at::kFloat, "F32"}, {at::kHalf, "F16"}, {at::kBFloat16, "BF16"},
      {at::kLong, "I64"},   {at::kInt, "I32"},   {at::kShort, "I16"}, {at::kChar, "I8"},
      {at::kByte, "U8"},    {at::kBool, "BOOL"}};
  return codes;
}

std::string code_of(at::ScalarType t, const std::string& name) {
  for (const auto& [type, code] : dtype_codes()) {
    if (type == t) return code;
  }
  throw Error(detail::concat("safetensors has no dtype code for tensor '", name, "' of ", t,
                             "; convert it to a floating or integer dtype first"));
}

at::ScalarType type_of(const std::string& code, const std::string& path) {
  for (const auto& [type, c] : dtype_codes()) {
    if (c == code) return type;
  }
  throw Error("'" + path + "': safetensors dtype '" + code + "' is not one dtrain reads");
}

// The TorchScript mirror of an nn::Module tree: one class per module, holding the same tensors.
torch::jit::Module mirror(const torch::nn::Module& module, const std::shared_ptr<torch::jit::CompilationUnit>& cu,
                          const std::string& type_name, int& counter) {
  torch::jit::Module out(c10::QualifiedName("__torch__.dtrain_export." + type_name + "_" + std::to_string(counter++)),
                         cu, /*shouldMangle=*/false);
  for (const auto& p : module.named_parameters(/*recurse=*/false)) {
    out.register_parameter(p.key(), p.value(), /*is_buffer=*/false);
  }
  for (const auto& b : module.named_buffers(/*recurse=*/false)) {
    if (b.value().defined()) out.register_buffer(b.key(), b.value());
  }
  for (const auto& child : module.named_children()) {
    std::string kind = child.value()->name();  // "torch::nn::LinearImpl" -> "LinearImpl"
    kind = kind.substr(kind.find_last_of(':') + 1);
    if (kind.empty()) kind = "Module";
    out.register_module(child.key(), mirror(*child.value(), cu, kind, counter));
  }
  return out;
}

}  // namespace

void check_output_path(const std::string& path, const std::string& flag) {
  DTRAIN_CHECK(!path.empty(), flag, " is empty: give the file to write");
  struct stat st {};
  if (::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode)) {
    throw Error(flag + "=" + path + " is a directory; give the name of a file to write inside it");
  }
  const std::string dir = parent_dir(path);
  if (::stat(dir.c_str(), &st) != 0) {
    throw Error(flag + "=" + path + ": the directory '" + dir + "' does not exist; create it (mkdir -p " + dir +
                ") or choose another " + flag);
  }
  DTRAIN_CHECK(S_ISDIR(st.st_mode), flag, "=", path, ": '", dir, "' is not a directory; choose another ", flag);
  DTRAIN_CHECK(::access(dir.c_str(), W_OK) == 0, flag, "=", path, ": the directory '", dir,
               "' is not writable by this user; choose another ", flag, " or change its permissions");
}

void write_text_atomically(const std::string& path, const std::string& text) {
  check_output_path(path);
  write_atomically(path, [&](WritableFile& f) { f.append(text.data(), text.size()); });
}

NamedTensorList module_tensors(const torch::nn::Module& module) {
  NamedTensorList out;
  for (const auto& p : module.named_parameters()) out.emplace_back(p.key(), p.value());
  for (const auto& b : module.named_buffers()) {
    if (b.value().defined()) out.emplace_back(b.key(), b.value());
  }
  return out;
}

void save_safetensors(const std::string& path, const NamedTensorList& tensors,
                      const std::map<std::string, std::string>& metadata) {
  check_output_path(path);
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  std::vector<at::Tensor> host;
  std::set<std::string> names;
  int64_t offset = 0;
  for (const auto& [name, t] : tensors) {
    DTRAIN_CHECK(!name.empty() && name != "__metadata__", "safetensors: a tensor needs a name other than '",
                 name, "'");
    DTRAIN_CHECK(names.insert(name).second, "safetensors: the name '", name, "' is given twice");
    DTRAIN_CHECK(t.defined(), "safetensors: tensor '", name, "' is undefined");
    at::Tensor h = t.detach().to(at::kCPU).contiguous();
    const int64_t bytes = static_cast<int64_t>(h.nbytes());
    header[name] = {{"dtype", code_of(h.scalar_type(), name)},
                    {"shape", h.sizes().vec()},
                    {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
    host.push_back(h);
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');  // the data starts 8-byte aligned
  write_atomically(path, [&](WritableFile& f) {
    uint64_t n = text.size();
    unsigned char size[8];
    for (int i = 0; i < 8; ++i) size[i] = static_cast<unsigned char>(n >> (8 * i));  // little-endian
    f.append(reinterpret_cast<const char*>(size), 8);
    f.append(text.data(), text.size());
    for (const at::Tensor& h : host) f.append(static_cast<const char*>(h.const_data_ptr()), h.nbytes());
  });
}

NamedTensorList load_safetensors(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  DTRAIN_CHECK(in.good(), "cannot open '", path, "' to read");
  in.seekg(0, std::ios::end);
  const int64_t size = in.tellg();
  in.seekg(0);
  unsigned char raw[8] = {};
  DTRAIN_CHECK(size >= 8 && in.read(reinterpret_cast<char*>(raw), 8), "'", path, "' is not a safetensors file (",
               size, " bytes)");
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | raw[i];
  DTRAIN_CHECK(n <= static_cast<uint64_t>(size - 8), "'", path, "' is not a safetensors file: its header of ", n,
               " bytes runs past the end");
  std::string text(n, '\0');
  in.read(text.data(), static_cast<std::streamsize>(n));
  nlohmann::ordered_json header;
  try {
    header = nlohmann::ordered_json::parse(text);
  } catch (const std::exception& e) {
    throw Error("'" + path + "' is not a safetensors file: its header is not JSON (" + e.what() + ")");
  }
  const int64_t data_start = 8 + static_cast<int64_t>(n);
  NamedTensorList out;
  for (const auto& [name, entry] : header.items()) {
    if (name == "__metadata__") continue;
    const at::ScalarType type = type_of(entry.at("dtype").get<std::string>(), path);
    const std::vector<int64_t> shape = entry.at("shape").get<std::vector<int64_t>>();
    const int64_t begin = entry.at("data_offsets").at(0).get<int64_t>(), end = entry.at("data_offsets").at(1).get<int64_t>();
    at::Tensor t = at::empty(shape, at::TensorOptions().dtype(type));
    DTRAIN_CHECK(begin >= 0 && end - begin == static_cast<int64_t>(t.nbytes()) && data_start + end <= size, "'", path,
                 "': tensor '", name, "' has byte range [", begin, ", ", end, ") for ", t.nbytes(),
                 " bytes, in a data section of ", size - data_start);
    in.seekg(data_start + begin);
    in.read(static_cast<char*>(t.data_ptr()), static_cast<std::streamsize>(t.nbytes()));
    out.emplace_back(name, t);
  }
  return out;
}

int64_t trace_to_torchscript(torch::nn::Module& module,
                             const std::function<at::Tensor(const std::vector<at::Tensor>&)>& forward,
                             const std::vector<at::Tensor>& example_inputs, const std::string& type_name,
                             const std::string& path) {
  check_output_path(path);
  auto cu = std::make_shared<torch::jit::CompilationUnit>();
  int counter = 0;
  torch::jit::Module traced = mirror(module, cu, type_name, counter);
  torch::jit::Stack inputs;
  for (const at::Tensor& t : example_inputs) inputs.emplace_back(t);
  std::shared_ptr<torch::jit::Graph> graph;
  try {
    auto [state, outputs] = torch::jit::tracer::trace(
        std::move(inputs),
        [&](torch::jit::Stack in) -> torch::jit::Stack {
          std::vector<at::Tensor> args;
          for (const c10::IValue& v : in) args.push_back(v.toTensor());
          return {forward(args)};
        },
        [](const at::Tensor&) { return std::string(); }, /*strict=*/true, /*force_outplace=*/false, &traced);
    graph = state->graph;
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {
    throw Error(std::string("tracing the model for TorchScript failed: ") + e.what());
  }
  auto method = cu->create_function(c10::QualifiedName(*traced.type()->name(), "forward"), graph);
  traced.type()->addMethod(method);
  std::ostringstream bytes;
  traced.save(bytes);
  const std::string archive = bytes.str();
  write_atomically(path, [&](WritableFile& f) { f.append(archive.data(), archive.size()); });
  return std::distance(graph->nodes().begin(), graph->nodes().end());
}

at::Tensor run_torchscript(const std::string& path, const std::vector<at::Tensor>& inputs) {
  torch::jit::Module m = torch::jit::load(path);
  m.eval();
  std::vector<c10::IValue> args(inputs.begin(), inputs.end());
  return m.forward(args).toTensor();
}

}  // namespace dtrain::engine
