// The one-step-delayed update of optimizer offload on one rank with host parameters (CPU
// training, and the streamed blocks of layer offload): the update takes the parameters' own
// gradient tensors instead of copying them into a host buffer, and publishes by swapping two
// weight buffers instead of copying the new weights into the parameters. Checked against the
// hand-driven reference of offload_engine_cases.h (ATen's optimizer, its result shown one step
// late), and for what it must not do: leave a gradient the next backward would add into, or
// copy.
#include <gtest/gtest.h>

#include <set>

#include "dtrain/dist/error.h"

#include "offload_engine_cases.h"

namespace dtrain::engine::offload_engine_cases {
namespace {


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

// A bucket per parameter: which buckets an observer reads is then which parameters it reads.
ReducerOptions bucket_per_parameter() {
  ReducerOptions o;
  o.first_bucket_bytes = 1;
  o.bucket_bytes = 1;
  return o;
}

// One rank's reducer with a bucket observer that reads some parameters (optimizer offload's
// gradient stream of --offload=all's device part): those parameters' buckets are reported and
// are views; the others keep autograd's own gradients, dropped at zero_grad as without an
// observer. The gradients are autograd's in every case (a plain backward of the same net).
TEST(OneRankReducer, AnObserverMakesViewsOfTheBucketsItReadsOnly) {
  std::unique_ptr<dist::Communicator> comm = testing_util::local_comm();
  torch::nn::Sequential net = offload_net(0, kCpu), ref = offload_net(0, kCpu);
  std::vector<at::Tensor> params = net->parameters();
  ASSERT_EQ(params.size(), 6u);
  GradReducer reducer(params, *comm, bucket_per_parameter());
  ASSERT_EQ(reducer.num_buckets(), 6);
  EXPECT_TRUE(reducer.keeps_autograd_gradients());
  std::vector<char> observed(params.size(), 0);
  observed[0] = observed[1] = 1;  // the first Linear
  std::vector<LaunchedBucket> seen;
  reducer.set_bucket_observer([&](const LaunchedBucket& b) { seen.push_back(b); }, observed);
  EXPECT_FALSE(reducer.keeps_autograd_gradients());
  EXPECT_FALSE(reducer.keeps_autograd_gradients({params[1]}));
  EXPECT_TRUE(reducer.keeps_autograd_gradients({params[2], params[3], params[5]}));
  EXPECT_THROW(reducer.keeps_autograd_gradients({at::zeros({3})}), Error);
  EXPECT_TRUE(reducer.holds(params[5]));
  EXPECT_FALSE(reducer.holds(params[5].detach().clone()));  // an equal tensor is not the parameter
  EXPECT_THROW(reducer.set_bucket_observer([](const LaunchedBucket&) {}, std::vector<char>(2, 1)), Error);
  for (int64_t step = 0; step < 3; ++step) {  // the buckets are rebuilt after the first
    seen.clear();
    auto [x, y] = offload_batch(step, 4, kCpu);
    torch::mse_loss(net->forward(x), y).backward();
    ref->zero_grad();
    torch::mse_loss(ref->forward(x), y).backward();
    const std::vector<at::Tensor> want = ref->parameters();
    for (size_t i = 0; i < params.size(); ++i) {
      ASSERT_TRUE(params[i].grad().defined()) << "step " << step << ", parameter " << i;
      EXPECT_TRUE(at::equal(params[i].grad(), want[i].grad())) << "step " << step << ", parameter " << i;
      // Before the first zero_grad every gradient is its bucket's view, as without an observer.
      EXPECT_EQ(params[i].grad().is_view(), i < 2 || step == 0) << "step " << step << ", parameter " << i;
    }
    ASSERT_EQ(seen.size(), 2u) << "step " << step;
    std::set<size_t> reported;
    for (size_t k = 0; k < seen.size(); ++k) {
      EXPECT_EQ(seen[k].index, k);
      EXPECT_EQ(seen[k].count, 2u);
      ASSERT_EQ(seen[k].params.size(), 1u);
      const size_t i = seen[k].params[0];
      reported.insert(i);
      seen[k].work->wait();
      EXPECT_TRUE(at::equal(seen[k].values.view(params[i].sizes()), want[i].grad())) << "parameter " << i;
    }
    EXPECT_EQ(reported, (std::set<size_t>{0, 1}));
    reducer.zero_grad();
    for (size_t i = 0; i < params.size(); ++i) {
      EXPECT_EQ(params[i].grad().defined(), i < 2) << "after zero_grad, parameter " << i;
    }
    EXPECT_EQ(params[0].grad().abs().sum().item<float>(), 0.0f);
  }
  // Without the observer every gradient is autograd's again.
  reducer.set_bucket_observer(nullptr);
  EXPECT_TRUE(reducer.keeps_autograd_gradients());
  auto [x, y] = offload_batch(9, 4, kCpu);
  torch::mse_loss(net->forward(x), y).backward();
  reducer.zero_grad();
  for (size_t i = 0; i < params.size(); ++i) EXPECT_FALSE(params[i].grad().defined()) << "parameter " << i;
}

// --offload=all's two parts on one rank: the device part's optimizer streams its gradients
// (forced here, on the CPU), the host part's (layer offload's blocks) takes autograd's
// gradients as they are, and both updates, one step late, give what one delayed optimizer of
// every parameter gives (which MatchesTheReferenceOnOneRank checks against the reference).
TEST(OffloadDelayedLocal, BesideAGradientStreamTheOtherPartTakesItsGradients) {
  std::unique_ptr<dist::Communicator> comm = testing_util::local_comm();
  OffloadOptions streamed, taken;
  streamed.delayed_update_after = taken.delayed_update_after = 1;
  streamed.stream_gradients = "on";
  taken.stream_gradients = "off";
  torch::nn::Sequential net = offload_net(0, kCpu);
  std::vector<at::Tensor> params = net->parameters();
  const std::vector<at::Tensor> device_part(params.begin(), params.begin() + 2);
  const std::vector<at::Tensor> host_part(params.begin() + 2, params.end());
  GradReducer reducer(params, *comm, bucket_per_parameter());
  OffloadedOptimizer device_opt(device_part, streaming_adamw(), *comm, streamed);
  OffloadedOptimizer host_opt(host_part, streaming_adamw(), *comm, taken);
  device_opt.attach(reducer);
  host_opt.attach(reducer);
  ASSERT_TRUE(device_opt.streams_gradients());
  ASSERT_FALSE(host_opt.streams_gradients());
  EXPECT_TRUE(reducer.keeps_autograd_gradients(host_part));
  OffloadOptions delayed;
  delayed.delayed_update_after = 1;
  offload_engine_cases::Run whole(*comm, kCpu, streaming_adamw(), delayed, small_buckets());
  for (int64_t step = 0; step < 6; ++step) {
    auto [x, y] = offload_batch(step, 4, kCpu);
    torch::mse_loss(net->forward(x), y).backward();
    whole.backward(step, 4, *comm);
    std::vector<const void*> host_grads;
    for (const at::Tensor& p : host_part) host_grads.push_back(p.grad().data_ptr());
    device_opt.step();
    host_opt.step();
    whole.opt->step();
    for (size_t i = 0; i < host_part.size(); ++i) {  // taken once the update is delayed, not copied
      EXPECT_EQ(host_part[i].grad().defined(), step < 1) << "step " << step << ", parameter " << i;
    }
    for (const at::Tensor& p : device_part) EXPECT_TRUE(p.grad().defined() && p.grad().is_view()) << step;
    reducer.zero_grad();
    whole.reducer->zero_grad();
    EXPECT_EQ(max_rel_error(params, whole.net->parameters()), 0.0) << "weights after step " << step;
    EXPECT_EQ(host_opt.update_in_flight(), step >= 1);
  }
  device_opt.flush();
  host_opt.flush();
  whole.opt->flush();
  EXPECT_EQ(max_rel_error(params, whole.net->parameters()), 0.0) << "after flush";
}

}  // namespace
}  // namespace dtrain::engine::offload_engine_cases
