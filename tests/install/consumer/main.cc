// An outside program on the installed dtrain, as a user writes one: its own model and dataset,
// dtrain's command line and trainer, data parallelism over whatever ranks it is started with.
// Prints "dtrain <version>: <steps> steps on <ranks> rank(s), loss <last>".
// <glog/logging.h> comes first, as in many programs: libtorch's headers, included after it,
// would replace glog's LOG macros with c10's (which drop INFO) if dtrain's headers did not
// restore them; install_test.sh checks that the INFO line below is printed.
#include <glog/logging.h>

#include <cmath>
#include <cstdio>
#include <memory>
#include <vector>

#include <torch/nn.h>

#include "dtrain/dist/communicator.h"
#include "dtrain/dist/logging.h"
#include "dtrain/dist/mesh.h"
#include "dtrain/dist/world.h"
#include "dtrain/engine/core/version.h"
#include "dtrain/engine/train/cli.h"

// y = sin(x . w) for x drawn from the sample's index: a regression computed on demand.
class Waves : public dtrain::engine::Dataset {
 public:
  explicit Waves(int64_t n) : n_(n), w_(at::linspace(-1.0, 1.0, 8).to(at::kFloat)) {}
  int64_t size() const override { return n_; }
  std::vector<at::Tensor> get_batch(const std::vector<int64_t>& indices) const override {
    at::Tensor i = at::tensor(indices, at::kLong).to(at::kFloat).unsqueeze(1);
    at::Tensor x = at::cos(i * at::arange(1, 9, at::kFloat) * 0.37);
    return {x, at::sin(x.matmul(w_)).unsqueeze(1)};
  }

 private:
  int64_t n_;
  at::Tensor w_;
};

int main(int argc, char** argv) {
  namespace cli = dtrain::engine::cli;
  return cli::run_main("app", [&] {
    const cli::Flags& f = cli::parse(argc, argv, "app [flags]: an MLP regression on its own dataset",
                                     cli::kAllTopics & ~cli::kTensorParallel,
                                     {{"steps", "12"}, {"lr", "0.01"}, {"log_every", "1"}, {"progress", "false"},
                                      {"workers", "1"}, {"device", "cpu"}});
    dtrain::dist::World world = dtrain::dist::detect_world();
    dtrain::dist::init_logging(argv[0], world);
    LOG(INFO) << "consumer: an INFO line through glog";
    c10::Device device = dtrain::dist::select_device(world, dtrain::dist::parse_device_request(f.device));
    auto comm = dtrain::dist::create_communicator(f.backend, world, device);
    cli::agree_on_flags(*comm);
    dtrain::dist::Mesh mesh(*comm, 1);
    torch::manual_seed(static_cast<uint64_t>(f.seed));
    torch::nn::Sequential model(torch::nn::Linear(8, 32), torch::nn::Tanh(), torch::nn::Linear(32, 1));
    model->to(device);
    dtrain::engine::Trainer trainer(*model, [&](const dtrain::engine::Batch& b) {
      return torch::mse_loss(model->forward(b.fields[0]), b.fields[1]);
    }, mesh, device, cli::trainer_options(f, "adamw"));
    dtrain::engine::DataLoader loader(std::make_shared<Waves>(2048), cli::loader_options(f, f.batch_size, device));
    dtrain::engine::StepMetrics last = trainer.fit(loader);  // shards the loader over the ranks
    cli::exit_if_preempted(trainer, "app", world.rank);
    if (world.rank == 0) {
      std::printf("dtrain %s: %lld steps on %d rank(s), loss %.6f\n", dtrain::version(),
                  static_cast<long long>(last.step), world.size, last.loss);
    }
    return 0;
  });
}
