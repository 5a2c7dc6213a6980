// dtrain-prepare: text files -> llm.c token shards with a SentencePiece tokenizer (prepare.h).
//
//   dtrain-prepare --tokenizer=tokenizer.model --input=corpus/ --output_dir=shards
//       --prefix=corpus --val_tokens=1000000 [--shard_tokens=100000000] [--bos] [--eos]
//       [--documents=file|lines|jsonl [--jsonl_field=text]] [--threads=N] [--progress=true|false]
//
// Writes shards/corpus_val_000000.bin and shards/corpus_train_000001.bin, ... (docs/GUIDE.md,
// "Preparing token shards"), then prints one summary line on stdout. While it encodes, a progress
// line is redrawn on stderr (prepare.h) when stderr is a terminal, or as --progress says. Exit status 2 for a bad
// flag, input or output directory (the message says what to fix), 1 for other failures.
#include <gflags/gflags.h>
#include <glog/logging.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#include "prepare.h"
#include "sentencepiece_encoder.h"

DEFINE_string(tokenizer, "", "SentencePiece model file (e.g. Llama 2's tokenizer.model)");
DEFINE_string(input, "", "text files, directories (their regular files, sorted by name) or glob patterns, "
                         "separated by commas; UTF-8 text, a file with a NUL byte is refused");
DEFINE_string(output_dir, "", "existing directory for the shards (it must not hold shards of --prefix already)");
DEFINE_string(prefix, "data", "shard file names: PREFIX_val_000000.bin, PREFIX_train_000001.bin, ...");
DEFINE_int64(shard_tokens, 100000000, "tokens per train shard (the last one may hold fewer)");
DEFINE_int64(val_tokens, 0, "the first this many tokens go to PREFIX_val_000000.bin; 0: no validation shard");
DEFINE_bool(bos, true, "put the tokenizer's BOS id before each document");
DEFINE_bool(eos, false, "put the tokenizer's EOS id after each document");
DEFINE_string(documents, "file", "file: each input file is one document; lines: each non-empty line is one; jsonl: each "
              "line a JSON object whose --jsonl_field holds one (*.gz and *.zst inputs are decompressed in every mode)");
DEFINE_string(jsonl_field, "text", "--documents=jsonl: the field of each JSON object that holds its text");
DEFINE_int32(threads, 0, "encoding threads; 0: one per core (at most 16). The shards are the same for any count");
DEFINE_bool(progress, false, "redraw a progress line on stderr while encoding (bytes, documents, tokens, tokens/s, "
                             "ETA); when not given: only if stderr is a terminal");

namespace {

constexpr int kExitUsage = 2;  // dtrain's exit status for bad input (dtrain/dist/error.h)

std::vector<std::string> split_commas(const std::string& s) {
  std::vector<std::string> out;
  size_t start = 0;
  while (true) {
    const size_t comma = s.find(',', start);
    out.push_back(s.substr(start, comma == std::string::npos ? std::string::npos : comma - start));
    if (comma == std::string::npos) return out;
    start = comma + 1;
  }
}

// --progress as given, else whether stderr is a terminal.
bool show_progress() {
  gflags::CommandLineFlagInfo info;
  if (gflags::GetCommandLineFlagInfo("progress", &info) && !info.is_default) return FLAGS_progress;
  return ::isatty(STDERR_FILENO) == 1;
}

dtrain::prepare::PrepareOptions options_from_flags() {
  using dtrain::prepare::PrepareError;
  if (FLAGS_tokenizer.empty()) throw PrepareError("--tokenizer is required: a SentencePiece model file (tokenizer.model)");
  if (FLAGS_input.empty()) throw PrepareError("--input is required: text files, directories or glob patterns");
  if (FLAGS_output_dir.empty()) throw PrepareError("--output_dir is required: an existing directory for the shards");
  if (FLAGS_threads < 0) throw PrepareError("--threads=" + std::to_string(FLAGS_threads) + ": give 0 (one per core) or more");
  dtrain::prepare::PrepareOptions o;
  o.inputs = split_commas(FLAGS_input);
  o.output_dir = FLAGS_output_dir;
  o.prefix = FLAGS_prefix;
  o.shard_tokens = FLAGS_shard_tokens;
  o.val_tokens = FLAGS_val_tokens;
  o.bos = FLAGS_bos;
  o.eos = FLAGS_eos;
  o.documents = dtrain::prepare::parse_document_mode(FLAGS_documents);
  o.jsonl_field = FLAGS_jsonl_field;
  if (o.documents != dtrain::prepare::DocumentMode::kJsonl && !gflags::GetCommandLineFlagInfoOrDie("jsonl_field").is_default) {
    throw PrepareError("--jsonl_field names the text's field of JSON Lines records: give --documents=jsonl too");
  }
  if (o.jsonl_field.empty()) throw PrepareError("--jsonl_field is empty: name the field that holds each record's text");
  const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  o.threads = FLAGS_threads > 0 ? FLAGS_threads : std::min(cores, 16);
  o.progress_to = show_progress() ? stderr : nullptr;
  return o;
}

}  // namespace

int main(int argc, char** argv) {
  gflags::SetUsageMessage(
      "dtrain-prepare --tokenizer=tokenizer.model --input=FILES,DIRS,GLOBS --output_dir=DIR [--prefix=NAME] "
      "[--val_tokens=N] [--shard_tokens=N] [--bos] [--eos] [--documents=file|lines|jsonl [--jsonl_field=text]] "
      "[--threads=N] "
      "[--progress=true|false]: "
      "tokenizes text with SentencePiece into llm.c token shards (train_gpt --data=tokens reads them)");
  gflags::ParseCommandLineFlags(&argc, &argv, true);
  google::InitGoogleLogging(argv[0]);
  FLAGS_logtostderr = true;
  try {
    if (argc > 1) {
      throw dtrain::prepare::PrepareError(std::string("unexpected argument '") + argv[1] +
                                          "': give the text files with --input=a.txt,b.txt");
    }
    const dtrain::prepare::PrepareOptions options = options_from_flags();
    const auto encoder = dtrain::prepare::load_sentencepiece(FLAGS_tokenizer);
    LOG(INFO) << "dtrain-prepare: " << encoder->describe() << ", " << options.threads << " threads";
    const dtrain::prepare::PrepareSummary summary = dtrain::prepare::prepare_shards(options, *encoder);
    std::printf("%s\n", summary.line(options.output_dir).c_str());
    std::fflush(stdout);
    if (summary.train_tokens == 0) {
      std::fprintf(stderr, "dtrain-prepare: warning: every token went to the validation shard (--val_tokens=%lld); "
                   "no train shard was written\n", static_cast<long long>(options.val_tokens));
    }
    return 0;
  } catch (const dtrain::prepare::PrepareError& e) {
    std::fprintf(stderr, "dtrain-prepare: error: %s\n", e.what());
    return kExitUsage;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "dtrain-prepare: failed: %s\n", e.what());
    return 1;
  }
}
