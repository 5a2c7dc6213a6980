#include "distill.h"

#include <cmath>
#include <cstdio>
#include <map>

#include <ATen/ATen.h>
#include <ATen/core/Generator.h>
#include <ATen/CPUGeneratorImpl.h>
#include <gflags/gflags.h>
#include <glog/logging.h>
#include <torch/nn/module.h>

#include "dtrain/dist/error.h"
#include "dtrain/engine/parallel/distill.h"
#include "dtrain/engine/state/checkpoint.h"
#include "dtrain/engine/train/load.h"

DEFINE_string(teacher, "", "distil from this trained run's checkpoint directory (its shape from the checkpoint or --teacher_<shape flag>)");
DEFINE_double(distill_temperature, 2.0, "with --teacher: softmax temperature T of the soft targets");
DEFINE_double(distill_alpha, 0.5, "with --teacher: loss = alpha T^2 KL(teacher||student) + (1 - alpha) cross-entropy");
DEFINE_bool(teacher_bf16, false, "with --teacher: run the teacher in bfloat16");
DEFINE_bool(teacher_offload, false, "with --teacher: keep the teacher's blocks in host memory, streamed per block (train_gpt)");
// The teacher's shape (0: the teacher checkpoint's record, else the student's). Not in --help
// (--helpfull lists them): the --teacher line names the family.
DEFINE_int64(teacher_hidden, 0, "teacher's --hidden");
DEFINE_int32(teacher_depth, -1, "teacher's --depth (-1: the checkpoint's, else the student's)");
DEFINE_int64(teacher_d_model, 0, "teacher's --d_model");
DEFINE_int64(teacher_heads, 0, "teacher's --heads");
DEFINE_int32(teacher_layers, 0, "teacher's --layers");
DEFINE_int64(teacher_ff, 0, "teacher's --ff");
DEFINE_int64(teacher_vocab, 0, "teacher's --vocab (must equal the student's)");

namespace dtrain::examples {
namespace {

// The teacher's value of a shape flag given on the command line, or "" if not given.
std::string teacher_flag(const std::string& name) {
  gflags::CommandLineFlagInfo info;
  if (!gflags::GetCommandLineFlagInfo(("teacher_" + name).c_str(), &info) || info.is_default) return "";
  return info.current_value;
}

struct TeacherState {
  ExampleModel model;
  int64_t step = 0;  // of the checkpoint its weights came from
};

}  // namespace

void check_distill_flags(bool evaluating) {
  if (FLAGS_teacher.empty()) {
    for (const char* f : {"distill_temperature", "distill_alpha", "teacher_bf16", "teacher_offload"}) {
      gflags::CommandLineFlagInfo info;
      gflags::GetCommandLineFlagInfo(f, &info);
      DTRAIN_CHECK(info.is_default, "--", f, " has no effect without --teacher=DIR (the teacher's checkpoint directory)");
    }
    return;
  }
  engine::check_distill_options({FLAGS_distill_temperature, FLAGS_distill_alpha});
  DTRAIN_CHECK(!evaluating, "--teacher with --eval_only: distillation is a way of training; evaluate the student "
               "without --teacher");
  DTRAIN_CHECK(FLAGS_teacher != engine::cli::flags().save_dir, "--teacher=", FLAGS_teacher, " is this run's own "
               "--save_dir; point --teacher at the teacher's run directory");
}

namespace {

// The teacher directory's newest good checkpoint's meta (its recorded shape flags).
std::map<std::string, std::string> teacher_meta() {
  std::vector<std::string> skipped;
  engine::CheckpointStore store(FLAGS_teacher);
  const auto newest = store.latest_good(&skipped);
  DTRAIN_CHECK(newest.has_value(), "--teacher=", FLAGS_teacher, " holds no good checkpoint",
               skipped.empty() ? "" : " (" + std::to_string(skipped.size()) + " damaged or incomplete one(s) skipped)",
               "; train the teacher first with --save_dir=", FLAGS_teacher);
  return store.load(newest->path).meta;
}

// Builds the teacher with its shape flags (--teacher_<flag>, else the checkpoint's record, else
// the student's), then gives the student's flags back (and the random stream: the teacher's
// initialization is overwritten by its checkpoint anyway). Returns the flags it set.
std::string build_teacher(const Run& run, const ExampleModel& student, const std::map<std::string, std::string>& meta,
                          TeacherState& teacher) {
  std::string shape;
  gflags::FlagSaver saver;
  at::CPUGeneratorImpl* gen = at::check_generator<at::CPUGeneratorImpl>(at::detail::getDefaultCPUGenerator());
  const c10::intrusive_ptr<c10::TensorImpl> rng = gen->get_state();
  for (const std::string& name : model_flag_names(student.name)) {
    std::string value = teacher_flag(name);
    const char* from = "--teacher_";
    auto recorded = meta.find("shape." + name);
    if (recorded == meta.end()) recorded = meta.find("run." + name);  // --seq_len, --dropout (shape_meta())
    if (value.empty() && recorded != meta.end()) {
      value = recorded->second;
      from = "the checkpoint's ";
    }
    if (value.empty()) continue;  // the student's
    DTRAIN_CHECK(!gflags::SetCommandLineOption(name.c_str(), value.c_str()).empty(), "the teacher's ", name, "=",
                 value, " (", from, name, ") is not a valid value");
    shape += " --" + name + "=" + value;
  }
  if (auto checks = model_checks(student.name)) checks();
  teacher.model = build_example_model(student.name, run);
  gen->set_state(*rng);
  return shape;
}

// The teacher's weights from its checkpoint, cast and streamed as asked.
void load_teacher(const Run& run, TeacherState& teacher, const std::string& shape) {
  try {
    teacher.step = engine::load_weights(FLAGS_teacher, *teacher.model.module, *run.mesh, run.device);
  } catch (const Error& e) {
    throw Error(detail::concat("--teacher=", FLAGS_teacher, ": ", e.what(), ". The teacher was built with",
                               shape.empty() ? " the student's shape" : shape, "; give its shape with --teacher_<flag> "
                               "(--teacher_d_model, --teacher_layers, ...) or leave those out to use the checkpoint's "
                               "record"));
  }
  teacher.model.module->eval();
  if (FLAGS_teacher_bf16) teacher.model.module->to(at::kBFloat16);
  if (FLAGS_teacher_offload) {
    DTRAIN_CHECK(teacher.model.offload_layers, "--teacher_offload: ", run.program, "'s model has no blocks to stream "
                 "from host memory (train_gpt's has); drop --teacher_offload");
    teacher.model.offload_layers();  // after the load and the cast: the host copies are final
  }
}

}  // namespace

void attach_teacher(const Run& run, ExampleModel& student) {
  if (FLAGS_teacher.empty()) return;
  DTRAIN_CHECK(student.logits_and_targets, run.program, " cannot distil: the model has no logits to compare");
  auto teacher = std::make_shared<TeacherState>();
  const std::string shape = build_teacher(run, student, teacher_meta(), *teacher);
  DTRAIN_CHECK(teacher->model.classes == student.classes, "the teacher's vocabulary has ", teacher->model.classes,
               " entries (", teacher_flag("vocab").empty() ? "its checkpoint's record" : "--teacher_vocab", "), the "
               "student's ", student.classes, ": a teacher must share the student's vocabulary (its logits are the "
               "soft targets, entry by entry)");
  load_teacher(run, *teacher, shape);
  int64_t teacher_params = 0, student_params = 0;
  for (const auto& p : teacher->model.module->parameters()) teacher_params += p.numel();
  for (const auto& p : student.module->parameters()) student_params += p.numel();
  if (run.world.rank == 0) {
    LOG(INFO) << "distilling from the teacher of step " << teacher->step << " in " << FLAGS_teacher
              << " (" << (shape.empty() ? std::string("the student's shape") : shape.substr(1)) << "; " << teacher_params
              << " parameters on this rank, the student " << student_params << "), T=" << FLAGS_distill_temperature
              << ", alpha=" << FLAGS_distill_alpha << (FLAGS_teacher_bf16 ? ", teacher in bf16" : "")
              << (FLAGS_teacher_offload ? ", teacher's blocks streamed from host memory" : "");
  }

  const engine::DistillOptions options{FLAGS_distill_temperature, FLAGS_distill_alpha};
  const engine::LossFn hard = student.loss;
  auto student_module = student.module;
  auto logits_and_targets = student.logits_and_targets;
  const bool vocab_parallel = student.vocab_parallel && run.mesh->tp_size() > 1;
  dist::Communicator* tp = &run.mesh->tp();
  const int64_t classes = student.classes;
  // The trainer takes the student's module and this loss, not its spec's (whose post is the
  // plain cross-entropy): distillation is refused with --pp and --shard=parameters, which need
  // the spec, and the student's checkpointing and layer streaming stay its applied model's.
  student.spec.reset();
  student.loss = [=](const engine::Batch& b) {
    if (!student_module->is_training()) return hard(b);  // evaluation: the plain loss
    at::Tensor teacher_logits;
    {
      at::NoGradGuard no_grad;
      engine::Batch in = b;
      if (FLAGS_teacher_bf16) {
        for (at::Tensor& f : in.fields) {
          if (f.is_floating_point()) f = f.to(at::kBFloat16);
        }
      }
      teacher_logits = teacher->model.logits_and_targets(in).first;
    }
    auto [logits, targets] = logits_and_targets(b);
    if (!vocab_parallel) return engine::distillation_loss(logits, teacher_logits, targets, options);
    const int64_t local = logits.size(-1);
    return engine::vocab_parallel_distillation_loss(logits, teacher_logits, targets, local * tp->rank(), classes, *tp,
                                                    options);
  };
}

}  // namespace dtrain::examples
