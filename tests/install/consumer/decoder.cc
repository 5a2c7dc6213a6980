// An outside program's own decoder model on the installed dtrain, declared as plain modules and
// a ModelSpec: the Trainer gives it ZeRO-3 (--shard=parameters), pipeline stages (--pp),
// tensor parallelism (--tp, through dtrain's parallel layers), activation checkpointing and
// layer offload from the command line, with nothing of them in the model. install_test.sh
// checks that each layout logs the loss curve of one rank.
// Prints "decoder: <steps> steps on <ranks> rank(s), loss <last>".
#include <cstdio>
#include <memory>
#include <vector>

#include <torch/nn.h>

#include "dtrain/dist/communicator.h"
#include "dtrain/dist/logging.h"
#include "dtrain/dist/mesh.h"
#include "dtrain/dist/world.h"
#include "dtrain/engine/models/blocks.h"
#include "dtrain/engine/models/model_spec.h"
#include "dtrain/engine/parallel/tensor_parallel.h"
#include "dtrain/engine/train/cli.h"

namespace {

constexpr int64_t kVocab = 40, kModel = 16, kSeq = 8, kLayers = 4;

struct BlockImpl : torch::nn::Module {
  explicit BlockImpl(dtrain::dist::Communicator& tp) {
    norm = register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({kModel})));
    mlp = register_module("mlp", dtrain::engine::ParallelMlp(kModel, 2 * kModel, tp));
  }
  at::Tensor forward(const at::Tensor& x) { return x + mlp->forward(norm->forward(x)); }
  torch::nn::LayerNorm norm{nullptr};
  dtrain::engine::ParallelMlp mlp{nullptr};
};
TORCH_MODULE(Block);

struct DecoderImpl : torch::nn::Module {
  explicit DecoderImpl(dtrain::dist::Communicator& comm) : tp(&comm) {
    embed = register_module("embed", dtrain::engine::VocabParallelEmbedding(kVocab, kModel, comm));
    blocks = register_module("blocks", dtrain::engine::BlockStack());
    for (int i = 0; i < kLayers; ++i) blocks->push_back(Block(comm));
    norm = register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({kModel})));
    dtrain::engine::ParallelLinearOptions o(kModel, kVocab);
    o.bias = false;
    o.pad_output = true;
    head = register_module("head", dtrain::engine::ColumnParallelLinear(o, comm));
  }
  at::Tensor pre(const dtrain::engine::Batch& b) { return embed->forward(b.fields[0].narrow(1, 0, kSeq)); }
  at::Tensor post(const at::Tensor& h, const dtrain::engine::Batch& b) {
    at::Tensor logits = head->forward(norm->forward(h));
    const int64_t local = logits.size(-1);
    return dtrain::engine::vocab_parallel_cross_entropy(logits.reshape({-1, local}),
                                                        b.fields[0].narrow(1, 1, kSeq).reshape({-1}),
                                                        local * tp->rank(), kVocab, *tp);
  }
  dtrain::dist::Communicator* tp;
  dtrain::engine::VocabParallelEmbedding embed{nullptr};
  dtrain::engine::BlockStack blocks{nullptr};
  torch::nn::LayerNorm norm{nullptr};
  dtrain::engine::ColumnParallelLinear head{nullptr};
};

dtrain::engine::ModelSpec spec_of(const std::shared_ptr<DecoderImpl>& m) {
  dtrain::engine::ModelSpec s;
  s.module = m;
  s.blocks = m->blocks;
  s.blocks_prefix = "blocks.";
  s.pre = [m](const dtrain::engine::Batch& b) { return m->pre(b); };
  s.post = [m](const at::Tensor& h, const dtrain::engine::Batch& b) { return m->post(h, b); };
  s.pre_modules = {"embed"};
  s.post_modules = {"norm", "head"};
  s.activation_shape = [](int64_t rows) { return std::vector<int64_t>{rows, kSeq, kModel}; };
  return s;
}

// Token windows of a fixed random sequence: sample i holds tokens [i, i + kSeq + 1).
class Windows : public dtrain::engine::Dataset {
 public:
  Windows() : tokens_(at::randint(kVocab, {4096}, at::kLong)) {}
  int64_t size() const override { return tokens_.numel() - kSeq - 1; }
  std::vector<at::Tensor> get_batch(const std::vector<int64_t>& indices) const override {
    at::Tensor out = at::empty({static_cast<int64_t>(indices.size()), kSeq + 1}, at::kLong);
    for (size_t r = 0; r < indices.size(); ++r) out[static_cast<int64_t>(r)].copy_(tokens_.narrow(0, indices[r], kSeq + 1));
    return {out};
  }

 private:
  at::Tensor tokens_;
};

}  // namespace

int main(int argc, char** argv) {
  namespace cli = dtrain::engine::cli;
  return cli::run_main("decoder", [&] {
    const cli::Flags& f = cli::parse(argc, argv, "decoder [flags]: an own decoder model given by its ModelSpec",
                                     cli::kAllTopics,
                                     {{"steps", "6"}, {"lr", "0.01"}, {"log_every", "1"}, {"progress", "false"},
                                      {"workers", "0"}, {"device", "cpu"}, {"batch_size", "8"}});
    // World, logging, device, communicator, the flags agreed, mesh and seed: the library's run.
    const dtrain::engine::RunOptions r = cli::run_options(f);
    dtrain::engine::Run run = dtrain::engine::start_run(r, argv[0], "decoder");
    const dtrain::dist::World& world = run.world;
    const c10::Device device = run.device;
    dtrain::dist::Mesh& mesh = *run.mesh;
    auto data = std::make_shared<Windows>();  // drawn after the seed: the same on every rank
    auto model = std::make_shared<DecoderImpl>(mesh.tp());
    dtrain::engine::ModelSpec spec = spec_of(model);
    dtrain::engine::ModelTechniques stage;
    dtrain::engine::split_pipeline_stage(spec, mesh.pp_rank(), mesh.pp_size(), r.pp_blocks, stage);
    model->to(device);
    dtrain::engine::TrainerOptions o = cli::trainer_options(f, "adamw", mesh.tp_size());
    o.oom_backoff = false;
    dtrain::engine::Trainer trainer(spec, mesh, device, o);
    dtrain::engine::DataLoader loader(data, cli::loader_options(f, f.batch_size, device));
    dtrain::engine::StepMetrics last = trainer.fit(loader);
    cli::exit_if_preempted(trainer, "decoder", world.rank);
    if (world.rank == 0) {
      std::printf("decoder: %lld steps on %d rank(s), loss %.6f\n", static_cast<long long>(last.step), world.size,
                  last.loss);
    }
    return 0;
  });
}
