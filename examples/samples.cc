// train_gpt's samples during training (samples.h).
#include "samples.h"

#include <cstdio>

#include "dtrain/dist/error.h"
#include "dtrain/engine/data/tokenizer.h"
#include "dtrain/engine/models/generate.h"
#include "dtrain/engine/models/gpt.h"
#include "dtrain/engine/models/llama.h"

DEFINE_string(tokenizer, "", "a SentencePiece model (tokenizer.model, e.g. Llama 2's or dtrain-prepare's): text prompts "
              "in and text out (dtrain-generate, --sample_every); dtrain-export --format=hf writes it beside the weights");
DEFINE_int64(sample_every, 0, "every N steps (a multiple of --log_every) print a continuation of --sample_prompt (needs "
             "--tokenizer); 0: none");
DEFINE_string(sample_prompt, "", "the text the samples continue, after the tokenizer's BOS (empty: the BOS alone)");
DEFINE_int64(sample_tokens, 64, "new tokens per sample");
DEFINE_double(sample_temperature, 1.0, "the samples' temperature (0: greedy), among the 40 most likely tokens");

namespace dtrain::examples {

engine::Decoder generation_calls(const ExampleModel& model, const std::string& who) {
  if (auto llama = std::dynamic_pointer_cast<engine::LlamaImpl>(model.module)) return engine::decoder_of(llama, FLAGS_vocab);
  if (auto gpt = std::dynamic_pointer_cast<engine::GptImpl>(model.module)) return engine::decoder_of(gpt, FLAGS_vocab);
  DTRAIN_CHECK(false, who, ": the ", model.name, " model cannot generate (the Llama and the GPT can)");
  return {};
}

void attach_samples(const Run& run, const ExampleModel& model, engine::TrainerOptions& options) {
  if (FLAGS_sample_every == 0) {  // the samples' flags do nothing then: said, not ignored
    for (const char* flag : {"tokenizer", "sample_prompt", "sample_tokens", "sample_temperature"}) {
      DTRAIN_CHECK(gflags::GetCommandLineFlagInfoOrDie(flag).is_default, "--", flag, " is for the samples taken "
                   "while training, and --sample_every is 0 (none): add --sample_every=N, or drop --", flag);
    }
    return;
  }
  const auto& f = engine::cli::flags();
  DTRAIN_CHECK(FLAGS_sample_every > 0, "--sample_every=", FLAGS_sample_every, " must be >= 0 (0: no samples)");
  DTRAIN_CHECK(!FLAGS_tokenizer.empty(), "--sample_every needs --tokenizer=tokenizer.model (the SentencePiece model "
               "the data was tokenized with) to encode --sample_prompt and decode the samples");
  DTRAIN_CHECK(FLAGS_sample_every % f.log_every == 0, "--sample_every=", FLAGS_sample_every, " is not a multiple of "
               "--log_every=", f.log_every, ": samples are taken at logged steps");
  DTRAIN_CHECK(f.pp == 1 && f.cp == 1 && !f.sequence_parallel && f.shard != "parameters" &&
                   (f.offload == "none" || f.offload == "optimizer"),
               "--sample_every needs every block's weights on each tensor-parallel rank: not with --pp, --cp, "
               "--sequence_parallel, --shard=parameters or --offload=layers|all; sample from a checkpoint with "
               "dtrain-generate instead");
  DTRAIN_CHECK(f.offload_delayed_update_after < 0, "--sample_every with --offload_delayed_update_after: the CPU update "
               "of one step lands in the weights during the next, so a sample between them would read weights being "
               "written; sample from a checkpoint with dtrain-generate instead");
  DTRAIN_CHECK(FLAGS_sample_tokens >= 1, "--sample_tokens=", FLAGS_sample_tokens, " must be >= 1");
  DTRAIN_CHECK(FLAGS_sample_temperature >= 0, "--sample_temperature=", FLAGS_sample_temperature, " must be >= 0");
  const engine::Tokenizer tok = engine::Tokenizer::load(FLAGS_tokenizer);
  DTRAIN_CHECK(tok.vocab_size() <= FLAGS_vocab, "--tokenizer=", FLAGS_tokenizer, " has ", tok.vocab_size(),
               " pieces, more than --vocab=", FLAGS_vocab, ": give the tokenizer the data was made with");
  std::vector<int64_t> prompt;
  if (tok.bos_id() >= 0) prompt.push_back(tok.bos_id());
  for (int64_t id : tok.encode(FLAGS_sample_prompt)) prompt.push_back(id);
  DTRAIN_CHECK(!prompt.empty(), "--sample_prompt is empty and the tokenizer has no BOS: give a prompt");
  const int64_t length = static_cast<int64_t>(prompt.size()) + FLAGS_sample_tokens;
  DTRAIN_CHECK(length <= FLAGS_seq_len, "--sample_prompt's ", prompt.size(), " tokens and --sample_tokens=",
               FLAGS_sample_tokens, " need ", length, " positions, more than --seq_len=", FLAGS_seq_len,
               ": shorten them");
  engine::Decoder decoder = generation_calls(model, "--sample_every");
  decoder.vocab = tok.vocab_size();  // draw among the tokenizer's pieces (the model's may be padded past them)
  engine::GenerateOptions g;
  g.max_new_tokens = FLAGS_sample_tokens;
  g.sampling.temperature = FLAGS_sample_temperature;
  g.sampling.top_k = FLAGS_sample_temperature > 0 ? 40 : 0;
  g.eos = tok.eos_id();
  const uint64_t seed = static_cast<uint64_t>(f.seed);
  const int64_t every = FLAGS_sample_every;
  dist::Mesh* mesh = run.mesh.get();
  const c10::Device device = run.device;
  const bool logs = run.world.rank == 0;
  std::shared_ptr<torch::nn::Module> module = model.module;
  const std::string program = run.program;
  auto before = options.on_log;
  options.on_log = [=](const engine::StepMetrics& m) mutable {
    if (before) before(m);
    if (m.step % every != 0 || mesh->dp_rank() != 0) return;
    const bool training = module->is_training();
    module->eval();
    g.seed = seed + static_cast<uint64_t>(m.step);  // another sample each time, the same in every rerun
    const engine::Generated out = engine::generate(decoder, {prompt}, g, mesh->tp(), device);
    module->train(training);
    if (!logs) return;
    std::vector<int64_t> all = prompt;
    all.insert(all.end(), out.rows[0].begin(), out.rows[0].end());
    const std::string text = tok.decode(all);
    std::printf("%s: sample at step %lld (%zu tokens, %.2f s): %s\n", program.c_str(), static_cast<long long>(m.step),
                out.rows[0].size(), out.total_s, text.c_str());
    std::fflush(stdout);
  };
}

}  // namespace dtrain::examples
