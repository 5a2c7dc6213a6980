// A backward pass split into its input-gradient and weight-gradient halves (split_backward.h).
#include "dtrain/engine/parallel/split_backward.h"

#include <algorithm>
#include <cstdint>
#include <unordered_map>
#include <utility>
#include <vector>

#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>
#include <torch/csrc/autograd/variable.h>

#include "dtrain/dist/error.h"

namespace dtrain::engine {

namespace {

using torch::autograd::Edge;
using torch::autograd::edge_list;
using torch::autograd::Node;
using torch::autograd::variable_list;

// What the second half runs from one boundary operation.
struct Capture {
  std::shared_ptr<Node> node;
  variable_list grads;  // the gradients the operation was given in the first half
  bool armed = true;    // until the first half hands them over
  edge_list leaves;     // the AccumulateGrad edges beyond it: the second half's outputs
};

// Keeps the gradients a boundary operation is given in the first half (only then: the second
// half runs the operation again).
class KeepGradients final : public torch::autograd::FunctionPreHook {
 public:
  explicit KeepGradients(std::weak_ptr<Capture> capture) : capture_(std::move(capture)) {}
  variable_list operator()(const variable_list& grads) override {
    if (std::shared_ptr<Capture> c = capture_.lock(); c && c->armed) {
      c->grads = grads;
      c->armed = false;
    }
    return grads;
  }

 private:
  std::weak_ptr<Capture> capture_;
};

// The graph below an output, in post-order (every node after the nodes it feeds into), with
// what each node's backward reaches: the input's accumulator, and which leaves.
struct GraphFacts {
  std::vector<Node*> order;
  std::unordered_map<Node*, size_t> id;
  std::vector<char> reaches_input;
  std::vector<std::vector<uint64_t>> leaves;  // bit j: leaf j (leaf_nodes[j]) is reached
  std::vector<Node*> leaf_nodes;

  GraphFacts(Node* root, const Node* input_leaf) {
    // Iterative depth-first post-order (graphs of deep models overflow a recursion).
    std::vector<std::pair<Node*, size_t>> stack{{root, 0}};
    id.emplace(root, 0);
    std::vector<Node*> found{root};
    while (!stack.empty()) {
      auto& [node, next] = stack.back();
      if (next < node->num_outputs()) {
        Node* child = node->next_edge(next++).function.get();
        if (child != nullptr && id.emplace(child, found.size()).second) {
          found.push_back(child);
          stack.emplace_back(child, 0);
        }
        continue;
      }
      order.push_back(node);
      stack.pop_back();
    }
    for (Node* n : found) {
      if (n != input_leaf && dynamic_cast<torch::autograd::AccumulateGrad*>(n) != nullptr) leaf_nodes.push_back(n);
    }
    std::unordered_map<Node*, size_t> leaf_bit;
    for (size_t j = 0; j < leaf_nodes.size(); ++j) leaf_bit.emplace(leaf_nodes[j], j);
    const size_t words = (leaf_nodes.size() + 63) / 64;
    reaches_input.assign(found.size(), 0);
    leaves.assign(found.size(), std::vector<uint64_t>(words, 0));
    for (Node* n : order) {  // children first
      const size_t k = id.at(n);
      if (n == input_leaf) reaches_input[k] = 1;
      if (auto it = leaf_bit.find(n); it != leaf_bit.end()) leaves[k][it->second / 64] |= uint64_t{1} << (it->second % 64);
      for (const Edge& e : n->next_edges()) {
        if (!e.function) continue;
        const size_t c = id.at(e.function.get());
        reaches_input[k] |= reaches_input[c];
        for (size_t w = 0; w < words; ++w) leaves[k][w] |= leaves[c][w];
      }
    }
  }
  bool any(const std::vector<uint64_t>& bits) const {
    return std::any_of(bits.begin(), bits.end(), [](uint64_t w) { return w != 0; });
  }
};

}  // namespace

struct SplitBackward::Impl {
  at::Tensor output, grad, input_grad;
  std::vector<std::shared_ptr<Capture>> captures;
  bool first_stage = false;
  bool done = false;
};

SplitBackward::SplitBackward(const at::Tensor& output, const at::Tensor& grad, const at::Tensor& input)
    : impl_(std::make_unique<Impl>()) {
  Impl& s = *impl_;
  DTRAIN_CHECK(output.defined() && output.requires_grad() && output.grad_fn(), "split backward: the output has no "
               "autograd graph (computed under no_grad, or from nothing that requires grad)");
  s.output = output;
  s.grad = grad;
  s.first_stage = !input.defined();
  if (s.first_stage) return;  // the second half is the whole backward
  DTRAIN_CHECK(input.is_leaf() && input.requires_grad(), "split backward: the input must be a leaf that requires "
               "grad (the activation a stage received)");
  const std::shared_ptr<Node> input_leaf = torch::autograd::impl::try_get_grad_accumulator(input);
  DTRAIN_CHECK(input_leaf != nullptr, "split backward: the output does not depend on the input; the stage before "
               "would get no gradient");
  const GraphFacts g(output.grad_fn().get(), input_leaf.get());
  DTRAIN_CHECK(g.reaches_input[g.id.at(output.grad_fn().get())], "split backward: the output does not depend on the "
               "input; the stage before would get no gradient");
  const size_t words = (g.leaf_nodes.size() + 63) / 64;
  for (Node* n : g.order) {
    const size_t k = g.id.at(n);
    if (!g.reaches_input[k]) continue;
    // A boundary operation: its backward feeds the input's path and a path to leaves only.
    std::vector<uint64_t> beyond(words, 0), on_path(words, 0);
    for (const Edge& e : n->next_edges()) {
      if (!e.function) continue;
      const size_t c = g.id.at(e.function.get());
      std::vector<uint64_t>& into = g.reaches_input[c] ? on_path : beyond;
      for (size_t w = 0; w < words; ++w) into[w] |= g.leaves[c][w];
    }
    if (!g.any(beyond)) continue;
    auto capture = std::make_shared<Capture>();
    capture->node = n->getptr();
    for (size_t j = 0; j < g.leaf_nodes.size(); ++j) {
      if (!(beyond[j / 64] >> (j % 64) & 1)) continue;
      DTRAIN_CHECK(!(on_path[j / 64] >> (j % 64) & 1), "--pp_schedule=zb: a parameter is read by the stage's '",
                   n->name(), "' and again by an earlier operation on the path to the stage's input (a weight "
                   "used twice in one stage, e.g. shared between layers); its gradient cannot be split from the "
                   "input's. Use --pp_schedule=1f1b for this model");
      capture->leaves.emplace_back(g.leaf_nodes[j]->getptr(), 0);
    }
    n->add_pre_hook(std::make_unique<KeepGradients>(capture));
    s.captures.push_back(std::move(capture));
  }
  const variable_list grads = torch::autograd::grad({output}, {input}, grad.defined() ? variable_list{grad}
                                                                                       : variable_list{},
                                                    /*retain_graph=*/true, /*create_graph=*/false);
  s.input_grad = grads.at(0);
  for (const std::shared_ptr<Capture>& c : s.captures) c->armed = false;  // the second half runs them again
}

SplitBackward::~SplitBackward() = default;

const at::Tensor& SplitBackward::input_grad() const { return impl_->input_grad; }

int SplitBackward::weight_runs() const {
  return impl_->first_stage ? 1 : static_cast<int>(impl_->captures.size());
}

void SplitBackward::weight_half() {
  Impl& s = *impl_;
  DTRAIN_CHECK(!s.done, "split backward: the weight half ran already");
  s.done = true;
  if (s.first_stage) {
    s.output.backward(s.grad);
  } else {
    torch::autograd::Engine& engine = torch::autograd::Engine::get_default_engine();
    for (const std::shared_ptr<Capture>& c : s.captures) {
      edge_list roots;
      variable_list grads;
      for (size_t i = 0; i < c->grads.size(); ++i) {
        if (!c->grads[i].defined()) continue;
        roots.emplace_back(c->node, static_cast<uint32_t>(i));
        grads.push_back(c->grads[i]);
      }
      if (roots.empty()) continue;  // nothing flowed into it (an output without a gradient)
      engine.execute(roots, grads, /*keep_graph=*/true, /*create_graph=*/false, /*accumulate_grad=*/true, c->leaves);
    }
  }
  s.captures.clear();
  s.output.reset();
  s.grad.reset();
}

}  // namespace dtrain::engine
