// The one-step-delayed update of optimizer offload on one rank with host parameters (CPU
// training, and the streamed blocks of layer offload): the update takes the parameters' own
// gradient tensors instead of copying them into a host buffer, and publishes by swapping two
// weight buffers instead of copying the new weights into the parameters. Checked against the
// hand-driven reference of offload_engine_cases.h (ATen's optimizer, its result shown one step
// late), and for what it must not do: leave a gradient the next backward would add into, or
// copy.
#include <gtest/gtest.h>

#include <set>

#include "offload_engine_cases.h"

namespace dtrain::engine::offload_engine_cases {
namespace {

const c10::Device kCpu(c10::kCPU);

TEST(OffloadDelayedLocal, MatchesTheReferenceOnOneRank) {
  std::unique_ptr<dist::Communicator> comm = testing_util::local_comm();
  expect_delayed_update_matches_reference(*comm, kCpu, "off");
  expect_delayed_update_matches_reference(*comm, kCpu, "on");  // streamed into host buffers: copied, then swapped
}

// A reducer that keeps the gradients in its buckets (here: reducing to an owner, the whole
// range) leaves .grad as views of them: those are copied, as with more ranks.
TEST(OffloadDelayedLocal, GradientsInTheReducersBucketsAreCopied) {
  std::unique_ptr<dist::Communicator> comm = testing_util::local_comm();
  int64_t numel = 0;
  for (auto& p : offload_net(0, kCpu)->parameters()) numel += p.numel();
  ReducerOptions ro = small_buckets();
  ro.owned.emplace_back(0, numel);
  {  // the premise: this reducer's gradients are views
    offload_engine_cases::Run run(*comm, kCpu, streaming_adamw(), OffloadOptions{}, ro);
    run.backward(0, 4, *comm);
    ASSERT_TRUE(run.net->parameters()[0].grad().is_view());
  }
  expect_delayed_update_matches_reference(*comm, kCpu, "off", ro);
}

TEST(OffloadDelayedLocal, TakesTheGradientsAndSwapsTheWeightBuffers) {
  std::unique_ptr<dist::Communicator> comm = testing_util::local_comm();
  OffloadOptions delayed;
  delayed.delayed_update_after = 1;
  offload_engine_cases::Run run(*comm, kCpu, streaming_adamw(), delayed, small_buckets());
  offload_engine_cases::Run ordinary(*comm, kCpu, streaming_adamw(), OffloadOptions{}, small_buckets());
  // No gradient buffers of its own: the same host memory as the ordinary update.
  EXPECT_EQ(run.opt->host_bytes(), ordinary.opt->host_bytes());
  std::vector<const void*> first_weight;
  std::vector<at::Tensor> seen;  // the gradients handed over (kept alive to compare storages)
  for (int64_t step = 0; step < 5; ++step) {
    run.backward(step, 4, *comm);
    std::vector<at::Tensor> params = run.net->parameters();
    std::vector<at::Tensor> grads;
    for (const at::Tensor& p : params) grads.push_back(p.grad());
    run.opt->step();
    first_weight.push_back(params[0].data_ptr());
    if (step >= 1) {  // delayed: the gradients went to the update, none is left to be added into
      for (size_t i = 0; i < params.size(); ++i) {
        EXPECT_FALSE(params[i].grad().defined()) << "step " << step << ", parameter " << i;
      }
    }
    for (const at::Tensor& g : grads) seen.push_back(g);
    run.reducer->zero_grad();
  }
  // Steps 2, 3 and 4 published by swapping: the weights alternate between two buffers, and
  // every parameter is a view of the same one.
  EXPECT_EQ(first_weight[2], first_weight[4]);
  EXPECT_NE(first_weight[2], first_weight[3]);
  std::set<const void*> storages;
  for (const at::Tensor& p : run.net->parameters()) storages.insert(p.storage().data());
  EXPECT_EQ(storages.size(), 1u);
  run.opt->flush();
  EXPECT_FALSE(run.opt->update_in_flight());
}

}  // namespace
}  // namespace dtrain::engine::offload_engine_cases
