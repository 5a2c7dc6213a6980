// train_gpt: a decoder language model. --model=gpt (the default): GPT-2 small's shape (12
// pre-norm blocks, d 768, 12 heads, sequence 1024, vocabulary 32000, untied head, AdamW, no
// dropout). --model=llama: the Llama layout (RMSNorm, rotary positions, SwiGLU, grouped-query
// attention; --kv_heads, --rope_theta, --tie_embeddings), its shape from a Hugging Face
// config.json with --hf_config and its weights from a Hugging Face checkpoint with
// --init_from_hf.
// --tp=T splits attention heads, the MLP and the vocabulary over T consecutive ranks
// (Megatron-style); the remaining factor of the world is data-parallel. --sequence_parallel
// also splits the residual stream and layer norms along the sequence over each tensor-parallel
// group (--seq_len must divide by --tp; no effect with --tp=1). --offload=layers
// streams the blocks' weights from host memory. By default it learns the license texts
// Debian ships (bytes as tokens); --data=synthetic uses random tokens.
//   dtrain-run -np 4 -- train_gpt --tp=2 --d_model=64 --heads=4 --layers=2 --seq_len=32 --vocab=96
#include <cstdio>

#include <gflags/gflags.h>
#include <glog/logging.h>

#include "dtrain/dist/error.h"

#include "common.h"
#include "distill.h"
#include "model_factory.h"
#include "samples.h"

DEFINE_string(model, "gpt", "gpt (GPT-2's layout) or llama (Llama's: RMSNorm, rotary positions, SwiGLU, grouped-query attention)");

using namespace dtrain;

int main(int argc, char** argv) {
  return examples::guarded_main("train_gpt", [&] {
    const std::string name = examples::flag_from_argv(argc, argv, "model", "gpt");  // selects the defaults
    engine::cli::describe_flags("Model", {"model"});
    engine::cli::describe_flags("Samples", {"sample_every", "sample_prompt", "sample_tokens", "sample_temperature",
                                            "tokenizer"});
    DTRAIN_CHECK(name == "gpt" || name == "llama", "--model=", name, ": train_gpt trains --model=gpt or --model=llama");
    examples::Run run = examples::init_run(argc, argv,
                                           "train_gpt [--model=gpt|llama] [flags]: a decoder language model (GPT-2 or "
                                           "Llama layout) with tensor parallelism",
                                           examples::model_flag_defaults(name), examples::model_checks(name),
                                           examples::model_flag_names(name));
    const int64_t S = FLAGS_seq_len;
    examples::ExampleModel model = examples::build_example_model(name, run);
    if (run.world.rank == 0) {
      LOG(INFO) << (name == "gpt" ? "GPT" : "Llama") << " with " << model.parameter_count / 1e6 << "M parameters, tp " << run.mesh->tp_size()
                << ", dp " << run.mesh->dp_size() << ", pp " << run.mesh->pp_size();
    }
    if (run.mesh->pp_size() > 1 && run.mesh->dp_rank() == 0 && run.mesh->tp_rank() == 0) {
      int64_t numel = 0;
      for (const at::Tensor& p : model.module->parameters()) numel += p.numel();
      LOG(INFO) << "pipeline stage " << run.mesh->pp_rank() << " of " << run.mesh->pp_size() << ": blocks "
                << model.blocks << (model.first_stage ? " + embeddings" : "")
                << (model.last_stage ? " + head and loss" : "") << ", " << numel / 1e6 << "M parameters"
                << (run.mesh->tp_size() > 1 ? " (this tensor-parallel rank's)" : "");
    }
    examples::attach_teacher(run, model);  // --teacher: distillation
    engine::TrainerOptions options = examples::trainer_options(run, model.default_optimizer);
    examples::attach_samples(run, model, options);  // --sample_every
    options.eval_perplexity = true;
    options.optimizer.beta2 = 0.95;
    options.tokens_per_sample = S;
    // The data first: where it lives on the device (a CPU run), --plan=auto counts it.
    examples::TokenData data = examples::token_data(run, S, /*fold_bytes=*/true);
    examples::plan_and_apply(run, model, options);
    // The library's GPT, given by its ModelSpec: the trainer applies the pipeline stage, ZeRO-3's
    // units, checkpointing and layer offload to its blocks.
    std::unique_ptr<engine::Trainer> trainer = examples::make_trainer(run, model, options);
    engine::DataLoader loader(data.train, examples::loader_options(run, engine::cli::flags().batch_size, true, engine::cli::flags().seed));
    auto eval = examples::eval_loader(run, data);
    engine::StepMetrics last = examples::fit_and_report(run, *trainer, *model.module, loader, eval.get());
    if (run.world.rank == 0 && run.device.is_cuda() && last.step_ms > 0) {
      // Model FLOPs per token: 6 N for the weights plus attention's 12 L d T (forward+backward),
      // N the whole model's. The job's tokens/s over all its GPUs, each at the H100's (and
      // H200's) dense peak of the step's matrix multiplies: bf16/fp16 989 TFLOP/s, float32 67
      // (libtorch leaves TF32 off). A user audit: the job's rate was divided by one GPU's peak
      // (N times too high on N GPUs), and float32 runs by the bf16 peak.
      const bool half = engine::cli::flags().amp != "off" ||
                        engine::parse_param_dtype(engine::cli::flags().param_dtype) != at::kFloat;
      const double peak = half ? 989e12 : 67e12;
      const double flops_per_token = 6.0 * model.parameter_count + 12.0 * FLAGS_layers * FLAGS_d_model * S;
      const double per_gpu = flops_per_token * last.samples_per_s * S / run.world.size;
      std::printf("train_gpt: %.1f TFLOP/s model FLOPs per GPU (MFU %.1f%% of %.0f TFLOP/s dense %s, %d GPU%s)\n",
                  per_gpu / 1e12, 100 * per_gpu / peak, peak / 1e12, half ? "bf16" : "float32", run.world.size,
                  run.world.size > 1 ? "s" : "");
    }
    return 0;
  });
}
