// dtrain-generate: continues prompts with the Llama model (--model=llama, the default) or the GPT
// (--model=gpt), a token at a time with a key/value cache (forward_cached, models/kv_cache.h),
// from a training run's checkpoint (--checkpoint, whatever its layout) or a Hugging Face
// checkpoint (--init_from_hf, with its config.json as --hf_config: a Llama's or GPT-2's), greedy
// or sampled (models/sampling.h).
//
//   dtrain-generate --init_from_hf=Llama-3.2-1B --hf_config=Llama-3.2-1B/config.json
//       --prompt_tokens=128000,791,6864 --max_new_tokens=32 --temperature=0
//   mpirun -np 2 dtrain-generate --tp=2 --model=llama [shape flags] --checkpoint=runs/llama --prompt_file=ids.txt
//
// Text in, text out with --tokenizer (a SentencePiece model, engine::Tokenizer): --prompt="..."
// or --prompt_file (one prompt a line), each prompt after the tokenizer's BOS (--bos), ended at
// its EOS (--eos defaults to it); stdout holds each sequence's text (--output=text) or one JSON
// object per sequence (--output=jsonl: prompt, ids, text, completion). Token ids in and out
// without it (--prompt_tokens, or --prompt_file of ids): one line per sequence, its new ids
// separated by commas (--output=ids). The summary (tokens/s) goes to stderr.
//
//   dtrain-generate --init_from_hf=Llama-2-7b-hf --hf_config=Llama-2-7b-hf/config.json
//       --tokenizer=Llama-2-7b-hf/tokenizer.model --prompt="The capital of France is" --temperature=0
//
// Under mpirun with --tp, every rank runs the same steps on its shard of the model; the full
// logits are gathered, tensor-parallel rank 0 draws the next tokens and broadcasts them, so the
// ranks never diverge; only rank 0 prints.
#include <sys/stat.h>

#include <algorithm>
#include <cstdio>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include <gflags/gflags.h>
#include <glog/logging.h>
#include <torch/utils.h>

#include "common.h"
#include "dtrain/dist/error.h"
#include "dtrain/engine/data/tokenizer.h"
#include "dtrain/engine/models/generate.h"
#include "dtrain/engine/models/gpt.h"
#include "dtrain/engine/models/llama.h"
#include "dtrain/engine/models/sampling.h"
#include "dtrain/engine/train/cli.h"
#include "dtrain/engine/train/load.h"
#include "model_factory.h"
#include "samples.h"  // --tokenizer

DEFINE_string(model, "llama", "the model: llama or gpt");
DEFINE_string(checkpoint, "", "the weights of a training run: its --save_dir (the newest good checkpoint, any layout)");
DEFINE_string(prompt_tokens, "", "the prompt as token ids, comma-separated (e.g. 1,15043,3186)");
DEFINE_string(prompt_file, "", "a file of prompts, one per line, generated as one batch (shorter ones left-padded): text "
              "with --tokenizer, else token ids (separated by commas or spaces)");
DEFINE_string(prompt, "", "the prompt as text (needs --tokenizer)");
DEFINE_bool(bos, true, "with --tokenizer: start each text prompt with the tokenizer's BOS id (as Llama's training did)");
DEFINE_string(output, "auto", "stdout: ids (the new ids of each sequence, a line each), text (each sequence's text, "
              "prompt and continuation; needs --tokenizer), jsonl (a JSON object per sequence); auto: text with "
              "--tokenizer, else ids");
DEFINE_int64(max_new_tokens, 32, "tokens to generate per sequence (the prompt and these must fit --seq_len / max_position_embeddings)");
DEFINE_double(temperature, 1.0, "sampling temperature; 0: greedy (the most likely token)");
DEFINE_int64(top_k, 0, "sample among the k most likely tokens (0: all)");
DEFINE_double(top_p, 1.0, "sample from the nucleus: the most likely tokens whose probability reaches p (1: all)");
DEFINE_int64(seed, 0, "the sampler's seed: the same seed, prompt and weights give the same tokens");
DEFINE_int64(batch, 1, "sequences per prompt (a lone prompt is repeated; with several prompts: 1 or their number)");
DEFINE_int64(eos, -1, "a token id that ends a sequence (it is printed; the run ends when every sequence has ended); -1: "
             "none, or with --tokenizer its EOS id when the flag is not given");
DEFINE_string(dtype, "float32", "the weights' and activations' dtype: float32, bfloat16, float16 or float64");
DEFINE_bool(stream, true, "--output=text of one sequence: print the text as the tokens come (else once at the end)");
DEFINE_bool(use_cache, true, "decode with the key/value cache; false: run the whole sequence again for every token (for comparison)");

using namespace dtrain;

namespace {

constexpr const char* kProgram = "dtrain-generate";

// The ids of one prompt: integers separated by commas and/or white space.
std::vector<int64_t> parse_ids(const std::string& text, const std::string& where) {
  std::string spaced = text;
  for (char& c : spaced) c = c == ',' ? ' ' : c;
  std::istringstream in(spaced);
  std::vector<int64_t> ids;
  for (std::string word; in >> word;) {
    size_t used = 0;
    int64_t id = -1;
    try {
      id = std::stoll(word, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    DTRAIN_CHECK(used == word.size() && id >= 0, where, ": '", word, "' is not a token id (ids are non-negative "
                 "integers; for a text prompt give --tokenizer=tokenizer.model and --prompt=TEXT or a --prompt_file of "
                 "text)");
    ids.push_back(id);
  }
  return ids;
}

// --tokenizer's model, loaded once (nullopt without the flag).
const std::optional<engine::Tokenizer>& tokenizer() {
  static const std::optional<engine::Tokenizer> tok =
      FLAGS_tokenizer.empty() ? std::nullopt : std::optional<engine::Tokenizer>(engine::Tokenizer::load(FLAGS_tokenizer));
  return tok;
}

// The ids of one text prompt: the tokenizer's BOS (--bos) and the text's ids.
std::vector<int64_t> encode_prompt(const std::string& text) {
  const engine::Tokenizer& tok = *tokenizer();
  std::vector<int64_t> ids;
  if (FLAGS_bos && tok.bos_id() >= 0) ids.push_back(tok.bos_id());
  const std::vector<int64_t> body = tok.encode(text);
  ids.insert(ids.end(), body.begin(), body.end());
  return ids;
}

// Where --init_from_hf's directory holds a tokenizer.model (Llama 2's, or dtrain-export
// --tokenizer's), the flag that uses it, for the messages that ask for --tokenizer.
std::string tokenizer_hint() {
  if (FLAGS_init_from_hf.empty()) return "";
  struct stat st {};
  const std::string path = FLAGS_init_from_hf + "/tokenizer.model";
  return ::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode) ? " (--init_from_hf's directory has one: --tokenizer=" +
                                                                     path + ")"
                                                               : "";
}

// The prompts of --prompt, --prompt_tokens or --prompt_file, each row one sequence (--batch
// applied), checked against the vocabulary.
std::vector<std::vector<int64_t>> read_prompts() {
  // --prompt="" is given too: the BOS alone (an unconditioned sample, as train_gpt's empty
  // --sample_prompt), or an error below when there is no BOS to start from.
  const bool prompt_given = !FLAGS_prompt.empty() || !gflags::GetCommandLineFlagInfoOrDie("prompt").is_default;
  const int given = prompt_given + !FLAGS_prompt_tokens.empty() + !FLAGS_prompt_file.empty();
  DTRAIN_CHECK(given == 1, given == 0 ? "no prompt: give --prompt=TEXT (with --tokenizer), --prompt_tokens=ID,ID,... "
                                        "or --prompt_file=FILE"
                                      : "more than one of --prompt, --prompt_tokens and --prompt_file given: give one");
  const bool text = tokenizer().has_value();
  DTRAIN_CHECK(text || !prompt_given, "--prompt is text: give --tokenizer=tokenizer.model (the SentencePiece "
               "model of the weights)", tokenizer_hint(), " to encode it, or the ids as --prompt_tokens");
  std::vector<std::vector<int64_t>> prompts;
  if (prompt_given) {
    prompts.push_back(encode_prompt(FLAGS_prompt));
  } else if (!FLAGS_prompt_tokens.empty()) {
    prompts.push_back(parse_ids(FLAGS_prompt_tokens, "--prompt_tokens"));
  } else {
    std::istringstream lines(examples::read_text_file(FLAGS_prompt_file, "--prompt_file"));
    int line_no = 0;
    for (std::string line; std::getline(lines, line);) {
      ++line_no;
      if (text && !line.empty() && line.back() == '\r') line.pop_back();
      if (text && line.find_first_not_of(" \t") == std::string::npos) continue;
      auto ids = text ? encode_prompt(line)
                      : parse_ids(line, "--prompt_file=" + FLAGS_prompt_file + " line " + std::to_string(line_no));
      if (!ids.empty()) prompts.push_back(ids);
    }
  }
  const std::string source = prompt_given ? std::string(FLAGS_prompt.empty() ? "--prompt=\"\" (with no BOS: --bos is "
                                                                            "off or the tokenizer has none)"
                                                                          : "--prompt")
                             : !FLAGS_prompt_tokens.empty() ? std::string("--prompt_tokens")
                                                            : "--prompt_file=" + FLAGS_prompt_file;
  DTRAIN_CHECK(!prompts.empty() && !prompts[0].empty(), source, " holds no token ids");
  for (size_t r = 0; r < prompts.size(); ++r) {
    DTRAIN_CHECK(FLAGS_use_cache || prompts[r].size() == prompts[0].size(), source, ": prompt ", r + 1, " has ",
                 prompts[r].size(), " tokens, prompt 1 has ", prompts[0].size(), "; prompts of unequal length are "
                 "left-padded in the key/value cache, and --use_cache=false recomputes without padding: drop it, or "
                 "run the prompts separately");
    for (int64_t id : prompts[r]) {
      DTRAIN_CHECK(id < FLAGS_vocab, source, ": token ", id, " is not below the vocabulary size ", FLAGS_vocab,
                   " (--vocab / --hf_config's vocab_size)");
      DTRAIN_CHECK(!text || id < tokenizer()->vocab_size(), source, ": token ", id, " is not below the tokenizer's ",
                   tokenizer()->vocab_size(), " pieces (", FLAGS_tokenizer, ")");
    }
  }
  DTRAIN_CHECK(FLAGS_batch >= 1, "--batch=", FLAGS_batch, " must be >= 1");
  DTRAIN_CHECK(prompts.size() == 1 || FLAGS_batch == 1 || FLAGS_batch == static_cast<int64_t>(prompts.size()),
               "--batch=", FLAGS_batch, " with ", prompts.size(), " prompts: each prompt is one sequence; drop --batch");
  if (prompts.size() == 1) prompts.assign(FLAGS_batch, prompts[0]);
  return prompts;
}

at::ScalarType parse_dtype(const std::string& name) {
  if (name == "float32") return at::kFloat;
  if (name == "bfloat16") return at::kBFloat16;
  if (name == "float16") return at::kHalf;
  if (name == "float64") return at::kDouble;
  DTRAIN_CHECK(false, "--dtype=", name, " is not one of: float32, bfloat16, float16, float64");
  return at::kFloat;
}

engine::SamplingOptions sampling_of_flags() {
  engine::SamplingOptions s;
  s.temperature = FLAGS_temperature;
  s.top_k = FLAGS_top_k;
  s.top_p = FLAGS_top_p;
  try {
    engine::check_sampling_options(s);
  } catch (const Error& e) {
    std::string m = e.what();
    const std::string prefix = "sampling: ";
    if (m.rfind(prefix, 0) == 0) m = "--" + m.substr(prefix.size());  // "--temperature must be >= 0 ..."
    throw Error(m);
  }
  DTRAIN_CHECK(s.temperature > 0 || (s.top_k == 0 && s.top_p == 1), "--top_k and --top_p choose among tokens to "
               "sample; --temperature=0 is greedy (the most likely token): drop them or give a temperature above 0");
  return s;
}

enum class Output { kIds, kText, kJsonl };

Output output_mode() {
  if (FLAGS_output == "auto") return tokenizer() ? Output::kText : Output::kIds;
  if (FLAGS_output == "ids") return Output::kIds;
  if (FLAGS_output == "jsonl") return Output::kJsonl;
  DTRAIN_CHECK(FLAGS_output == "text", "--output=", FLAGS_output, " is not one of: auto, ids, text, jsonl");
  DTRAIN_CHECK(tokenizer().has_value(), "--output=text decodes the tokens: give --tokenizer=tokenizer.model",
               tokenizer_hint(), " (or --output=ids)");
  return Output::kText;
}

// --tokenizer against the model's vocabulary; its EOS as --eos when the flag was not given.
void check_tokenizer_flags() {
  output_mode();
  if (!tokenizer()) {
    DTRAIN_CHECK(gflags::GetCommandLineFlagInfoOrDie("bos").is_default, "--bos adds the tokenizer's BOS to a text "
                 "prompt: give --tokenizer too (with --prompt_tokens, write the BOS id yourself)");
    return;
  }
  const engine::Tokenizer& tok = *tokenizer();
  DTRAIN_CHECK(tok.vocab_size() <= FLAGS_vocab, "--tokenizer=", FLAGS_tokenizer, " has ", tok.vocab_size(),
               " pieces, more than the model's vocabulary of ", FLAGS_vocab, " (--vocab / --hf_config's vocab_size): "
               "the weights were trained with another tokenizer; give the tokenizer.model that came with them");
  if (gflags::GetCommandLineFlagInfoOrDie("eos").is_default && tok.eos_id() >= 0) FLAGS_eos = tok.eos_id();
}

// The longest prompt's tokens (the others are left-padded to it).
int64_t longest(const std::vector<std::vector<int64_t>>& prompts) {
  size_t n = 0;
  for (const auto& p : prompts) n = std::max(n, p.size());
  return static_cast<int64_t>(n);
}

// The positions the model has: the GPT's learned ones (--seq_len, which --hf_config's n_positions
// sets), the Llama's --seq_len or --hf_config's max_position_embeddings.
int64_t max_positions() { return FLAGS_model == "gpt" ? FLAGS_seq_len : examples::llama_max_positions(); }

// Every check of the flags, before any communicator exists (the same on every rank).
void check_generate_flags() {
  const auto& f = engine::cli::flags();
  DTRAIN_CHECK(FLAGS_checkpoint.empty() || FLAGS_init_from_hf.empty(), "--checkpoint and --init_from_hf both "
               "given: choose one source of weights");
  DTRAIN_CHECK(!FLAGS_checkpoint.empty() || !FLAGS_init_from_hf.empty(), "no weights: give --checkpoint=DIR (a "
               "training run's --save_dir) or --init_from_hf=DIR (a Hugging Face checkpoint, with its config.json as "
               "--hf_config)");
  DTRAIN_CHECK(f.pp == 1, "--pp=", f.pp, ": ", kProgram, " runs the whole model on every rank of a tensor-parallel "
               "group; use --tp (the checkpoint loads at any layout)");
  DTRAIN_CHECK(!f.sequence_parallel, "--sequence_parallel: generation feeds a token at a time, which does not split "
               "along the sequence; drop it (the weights are the same)");
  DTRAIN_CHECK(f.cp == 1, "--cp=", f.cp, ": generation feeds a token at a time, which does not split along the "
               "sequence; drop it (the checkpoint loads at any layout)");
  parse_dtype(FLAGS_dtype);
  sampling_of_flags();
  check_tokenizer_flags();
  DTRAIN_CHECK(FLAGS_eos >= -1 && FLAGS_eos < FLAGS_vocab, "--eos=", FLAGS_eos, " is not a token id below the "
               "vocabulary size ", FLAGS_vocab, " (or -1: none)");
  const auto prompts = read_prompts();
  const int64_t P = longest(prompts), positions = max_positions();
  DTRAIN_CHECK(FLAGS_max_new_tokens >= 1, "--max_new_tokens=", FLAGS_max_new_tokens, " must be >= 1");
  DTRAIN_CHECK(P < positions, "the (longest) prompt has ", P, " tokens, and the model has ", positions,
               " positions (--seq_len, or --hf_config's max_position_embeddings): no room for a new token; shorten the "
               "prompt", positions > 1 ? " to at most " + std::to_string(positions - 1) + " tokens" : std::string());
  DTRAIN_CHECK(P + FLAGS_max_new_tokens <= positions, "--max_new_tokens=", FLAGS_max_new_tokens, ": the (longest) prompt's ", P,
               " tokens and ", FLAGS_max_new_tokens, " new ones need ", P + FLAGS_max_new_tokens,
               " positions, the model has ", positions, " (--seq_len, or --hf_config's max_position_embeddings); "
               "ask for at most ", positions - P, " new tokens");
}

// The model with its weights, converted to --dtype, in eval mode.
engine::Decoder load_model(const examples::Run& run, std::string& source) {
  examples::ExampleModel m = examples::build_example_model(FLAGS_model, run);  // --init_from_hf: loaded here
  engine::Decoder model = examples::generation_calls(m, kProgram);
  // Text out: draw among the tokenizer's pieces only (a model's vocabulary may be padded past them).
  if (tokenizer()) model.vocab = tokenizer()->vocab_size();
  if (!FLAGS_checkpoint.empty()) {
    const int64_t step = engine::load_weights(FLAGS_checkpoint, *m.module, *run.mesh, run.device, examples::shape_meta(run));
    source = FLAGS_checkpoint + " (step " + std::to_string(step) + ")";
  } else {
    source = FLAGS_init_from_hf;
  }
  m.module->to(parse_dtype(FLAGS_dtype));
  m.module->eval();
  return model;
}

// Prints one sequence's text while it is generated: after each token the text decoded so far,
// less what was printed; a trailing U+FFFD is held back (the bytes of a character that the next
// tokens complete, with byte-fallback pieces). finish() prints the rest and a newline, so stdout
// ends up with exactly the text --stream=false prints.
class TextStreamer {
 public:
  TextStreamer(const engine::Tokenizer& tok, std::vector<int64_t> prompt) : tok_(tok), ids_(std::move(prompt)) {
    emit(tok_.decode(ids_), false);
  }
  void add(int64_t id) {
    ids_.push_back(id);
    emit(tok_.decode(ids_), false);
  }
  void finish(const std::string& text) {
    emit(text, true);
    if (revised_) {  // a later token changed text already printed: never seen, but never silent
      std::fprintf(stderr, "%s: a later token changed the text already streamed; the whole text follows\n", kProgram);
      std::printf("\n%s", text.c_str());
    }
    std::printf("\n");
    std::fflush(stdout);
  }

 private:
  void emit(const std::string& text, bool final) {
    if (revised_) return;
    if (text.compare(0, printed_.size(), printed_) != 0) {
      revised_ = true;
      return;
    }
    static const std::string kReplacement = "\xEF\xBF\xBD";  // U+FFFD
    size_t end = text.size();
    while (!final && end >= printed_.size() + kReplacement.size() &&
           text.compare(end - kReplacement.size(), kReplacement.size(), kReplacement) == 0) {
      end -= kReplacement.size();
    }
    if (end <= printed_.size()) return;
    std::fwrite(text.data() + printed_.size(), 1, end - printed_.size(), stdout);
    std::fflush(stdout);
    printed_.assign(text, 0, end);
  }
  const engine::Tokenizer& tok_;
  std::vector<int64_t> ids_;
  std::string printed_;
  bool revised_ = false;
};

// Whether this run streams: text out, one sequence, rank 0.
bool streams(const examples::Run& run, size_t sequences) {
  return FLAGS_stream && output_mode() == Output::kText && sequences == 1 && run.world.rank == 0;
}

// The library's generate() with the flags' options.
engine::Generated generate(const examples::Run& run, const engine::Decoder& model,
                           const std::vector<std::vector<int64_t>>& prompts, TextStreamer* streamer) {
  engine::GenerateOptions o;
  o.max_new_tokens = FLAGS_max_new_tokens;
  o.sampling = sampling_of_flags();
  o.seed = static_cast<uint64_t>(FLAGS_seed);
  o.eos = FLAGS_eos;
  o.use_cache = FLAGS_use_cache;
  o.pad_id = tokenizer() && tokenizer()->pad_id() >= 0 ? tokenizer()->pad_id() : 0;
  bool ended = false;
  if (streamer) {
    o.on_token = [&](const at::Tensor& next) {
      if (ended) return;
      const int64_t id = next[0].item<int64_t>();
      streamer->add(id);
      ended = id == o.eos;
    };
  }
  return engine::generate(model, prompts, o, run.mesh->tp(), run.device);
}

// One sequence as --output asks: its new ids, its text (the prompt's and the new tokens' decoded
// together, so the first new word keeps its space), or a JSON object with both.
void print_sequence(const std::vector<int64_t>& prompt, const std::vector<int64_t>& row, int64_t r, int64_t rows) {
  const Output mode = output_mode();
  if (mode == Output::kIds) {
    std::string line;
    for (size_t i = 0; i < row.size(); ++i) line += (i ? "," : "") + std::to_string(row[i]);
    std::printf("%s\n", line.c_str());
    return;
  }
  std::vector<int64_t> all = prompt;
  all.insert(all.end(), row.begin(), row.end());
  if (mode == Output::kText) {
    if (rows > 1) std::printf("--- sequence %lld of %lld ---\n", static_cast<long long>(r + 1), static_cast<long long>(rows));
    const std::string text = tokenizer()->decode(all);
    std::printf("%s\n", text.c_str());
    return;
  }
  nlohmann::json j = {{"sequence", r}, {"prompt_ids", prompt}, {"ids", row}};
  if (tokenizer()) {
    const std::string head = tokenizer()->decode(prompt), text = tokenizer()->decode(all);
    j["prompt"] = head;
    j["text"] = text;
    j["completion"] = text.compare(0, head.size(), head) == 0 ? text.substr(head.size()) : tokenizer()->decode(row);
  }
  std::printf("%s\n", j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace).c_str());
}

void print(const examples::Run& run, const engine::Generated& g, const std::string& source,
           const std::vector<std::vector<int64_t>>& prompts, TextStreamer* streamer) {
  if (run.world.rank != 0) return;
  const int64_t prompt_len = longest(prompts);
  int64_t tokens = 0;
  for (size_t r = 0; r < g.rows.size(); ++r) {
    if (streamer) {  // the text is out already but its end: the whole text, decoded at once, completes it
      std::vector<int64_t> all = prompts[r];
      all.insert(all.end(), g.rows[r].begin(), g.rows[r].end());
      streamer->finish(tokenizer()->decode(all));
    } else {
      print_sequence(prompts[r], g.rows[r], static_cast<int64_t>(r), static_cast<int64_t>(g.rows.size()));
    }
    tokens += static_cast<int64_t>(g.rows[r].size());
  }
  std::fflush(stdout);
  const double decode_s = g.total_s - g.prefill_s;
  const int64_t B = static_cast<int64_t>(g.rows.size());
  std::fprintf(stderr,
               "%s: %lld new tokens in %lld sequences (longest prompt %lld tokens) in %.3f s: %.1f tokens/s; "
               "prefill %.4f s, "
               "then %lld steps at %.1f tokens/s (%s, %s, tp %d, %s on %s) from %s\n",
               kProgram, static_cast<long long>(tokens), static_cast<long long>(B), static_cast<long long>(prompt_len),
               g.total_s, tokens / std::max(g.total_s, 1e-9), g.prefill_s, static_cast<long long>(g.steps),
               g.steps * B / std::max(decode_s, 1e-9), FLAGS_use_cache ? "key/value cache" : "recomputing the sequence",
               FLAGS_temperature == 0 ? "greedy" : "sampled", run.mesh->tp_size(), FLAGS_dtype.c_str(),
               run.device.str().c_str(), source.c_str());
  std::fflush(stderr);
}

int generate_main(int argc, char** argv) {
  const std::string model_name = examples::flag_from_argv(argc, argv, "model", "llama");
  DTRAIN_CHECK(model_name == "llama" || model_name == "gpt", "--model=", model_name, ": the program generates with "
               "--model=llama or --model=gpt (the models with a key/value cache)");
  engine::cli::describe_flags("Generation", {"model", "checkpoint", "tokenizer", "prompt", "prompt_tokens",
                                             "prompt_file", "bos", "output", "max_new_tokens", "temperature", "top_k",
                                             "top_p", "seed", "batch", "eos", "dtype", "use_cache"});
  std::map<std::string, std::string> defaults;  // the model's shape defaults (not its training ones)
  const std::vector<std::string> shape = examples::model_flag_names(model_name);
  for (const auto& [flag, value] : examples::model_flag_defaults(model_name)) {
    if (std::find(shape.begin(), shape.end(), flag) != shape.end()) defaults[flag] = value;
  }
  defaults["dropout"] = "0";  // none when generating (model_checks refuses --dropout with --tp otherwise)
  // With --hf_config, the positions default to its max_position_embeddings (GPT-2: n_positions).
  const std::string hf_config = examples::flag_from_argv(argc, argv, "hf_config");
  if (!hf_config.empty()) {
    const std::string text = examples::read_text_file(hf_config, "--hf_config");
    defaults["seq_len"] = std::to_string(model_name == "gpt" ? engine::gpt_options_from_hf_config(text).seq_len
                                                             : engine::llama_options_from_hf_config(text).seq_len);
  }
  const auto base_checks = examples::model_checks(model_name);
  examples::Run run = examples::init_run(
      argc, argv,
      "dtrain-generate --model=llama|gpt [shape flags | --hf_config=config.json] --checkpoint=DIR | --init_from_hf=DIR\n"
      "    --tokenizer=tokenizer.model --prompt=TEXT | --prompt_tokens=ID,ID,... | --prompt_file=FILE\n"
      "    [--max_new_tokens=N] [--temperature=T --top_k=K --top_p=P --seed=S] [--output=ids|text|jsonl]\n"
      "Continues the prompt with the Llama model or the GPT and prints each sequence's text (with --tokenizer, a SentencePiece "
      "model) or its new token ids, one line per sequence (the summary goes to stderr).\nUnder mpirun with --tp=N (N "
      "ranks) the model is split; every rank runs the same steps and rank 0 prints.",
      defaults,
      [&] {
        base_checks();
        check_generate_flags();
      },
      shape,
      engine::cli::kRanks | engine::cli::kTensorParallel);
  DTRAIN_CHECK(run.world.size == run.mesh->tp_size(), "the ranks form one tensor-parallel group: start it with as "
               "many ranks as --tp (", run.mesh->tp_size(), "), not ", run.world.size);
  const auto prompts = read_prompts();
  std::string source;
  auto model = load_model(run, source);
  std::unique_ptr<TextStreamer> streamer;
  if (streams(run, prompts.size())) streamer = std::make_unique<TextStreamer>(*tokenizer(), prompts[0]);
  const engine::Generated g = generate(run, model, prompts, streamer.get());
  print(run, g, source, prompts, streamer.get());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  return examples::guarded_main(kProgram, [&] { return generate_main(argc, argv); });
}
