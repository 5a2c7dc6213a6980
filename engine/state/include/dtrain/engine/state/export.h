// Export of a trained model for deployment, in the two formats other tools load:
//
//  * safetensors (Hugging Face's format: an 8-byte little-endian header length, a JSON header
//    naming each tensor's dtype, shape and byte range, then the raw bytes), read by Python's
//    `safetensors.torch.load_file` and by every loader of that ecosystem;
//  * TorchScript archives made with libtorch's tracer (the one Python's torch.jit.trace drives)
//    from a C++ torch::nn::Module, loaded by Python's `torch.jit.load` and C++'s
//    `torch::jit::load` with no dtrain code.
//
// libtorch's C++ API has no trace for an nn::Module: trace_to_torchscript() mirrors the
// module tree as a TorchScript module that holds the very same parameter and buffer tensors
// (same names, same hierarchy), runs `forward` under the tracer with that module as `self`,
// so every parameter read becomes an attribute access, and adds the graph as its forward.
// As with any trace, control flow is recorded for the example inputs, and sizes that the C++
// code reads as integers (x.size(1), a view to [B, S, ...]) become constants: the archive
// accepts inputs of the example's shape (say so where it is deployed; see GUIDE.md).
//
// Files are written atomically: to a temporary file in the same directory, flushed, then
// renamed over `path`; on any failure nothing is left at `path` or beside it.
#pragma once

#include <functional>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>

namespace torch::nn {
class Module;
}

namespace dtrain::engine {

using NamedTensorList = std::vector<std::pair<std::string, at::Tensor>>;

// Throws dtrain::Error naming `path` and the fix when its directory does not exist, is not a
// directory, or is not writable, or when `path` is an existing directory. `flag` names the
// option in messages ("--output").
void check_output_path(const std::string& path, const std::string& flag = "--output");

// Writes `text` to path through a temporary file beside it, synced and renamed over path (a
// reader never sees a half-written file). Throws dtrain::Error as check_output_path().
void write_text_atomically(const std::string& path, const std::string& text);

// The module's parameters and buffers by their full names ("blocks.0.attn.qkv.weight"),
// parameters first, as named_parameters() and named_buffers() list them.
NamedTensorList module_tensors(const torch::nn::Module& module);

// Writes tensors (copied to the host, made contiguous) as a safetensors file with the given
// string metadata ("__metadata__"). Names must be unique and non-empty. Throws dtrain::Error
// for a dtype safetensors has no code for (complex, quantized) and as check_output_path().
void save_safetensors(const std::string& path, const NamedTensorList& tensors,
                      const std::map<std::string, std::string>& metadata = {});

// Reads a safetensors file (what save_safetensors writes; also other writers' files of the
// same dtypes) into CPU tensors, in file order. Throws dtrain::Error for a file that is not
// one (the header or a byte range out of bounds).
NamedTensorList load_safetensors(const std::string& path);

// Traces forward(example_inputs) over `module` (put it in eval mode first: dropout is traced
// as it runs) and writes the TorchScript archive to `path`. type_name names the archive's
// top-level class ("GPT"). Returns the number of nodes of the traced graph. Throws
// dtrain::Error when tracing fails (e.g. forward reads a tensor that is neither an input nor a
// parameter or buffer of `module` and is not a constant) and as check_output_path().
int64_t trace_to_torchscript(torch::nn::Module& module,
                             const std::function<at::Tensor(const std::vector<at::Tensor>&)>& forward,
                             const std::vector<at::Tensor>& example_inputs, const std::string& type_name,
                             const std::string& path);

// Loads a TorchScript archive with torch::jit::load and runs its forward on inputs (the C++
// deployment path; also how dtrain-export checks what it wrote).
at::Tensor run_torchscript(const std::string& path, const std::vector<at::Tensor>& inputs);

}  // namespace dtrain::engine

#include "dtrain/dist/glog_compat.h"  // last: keeps glog's LOG macros whatever the include order
