// Knowledge distillation for the example programs (--teacher=DIR): the student's loss becomes
// engine::distillation_loss against the logits of a teacher loaded from a training run's
// checkpoint directory (docs/GUIDE.md, "Knowledge distillation").
#pragma once

#include <memory>

#include "common.h"
#include "model_factory.h"

namespace dtrain::examples {

// Without --teacher: nothing. With it: builds the teacher (the example's model with the
// teacher's shape: each --teacher_<shape flag> given, else the teacher checkpoint's record of
// its shape, else the student's), split over --tp like the student; loads the newest good
// checkpoint of --teacher into it (any layout: tensor-parallel checkpoints are re-split);
// keeps it in eval mode (bf16 with --teacher_bf16; with --teacher_offload its blocks live in
// host memory and are streamed to the device one at a time, as --offload=layers does); and replaces student.loss so that, while
// the student trains, each batch's loss is
//   alpha * T^2 * KL(softmax(teacher/T) || softmax(student/T)) + (1 - alpha) * cross-entropy
// (vocabulary-parallel for the GPT under --tp, without gathering the logits). Evaluation keeps
// the plain cross-entropy, so eval losses compare with and without a teacher. The teacher runs
// under no_grad. Throws dtrain::Error for a teacher whose shape disagrees with its checkpoint,
// whose vocabulary differs from the student's, or bad --distill_* values. Collective (the
// teacher's load is, like a resume).
void attach_teacher(const Run& run, ExampleModel& student);

// Refuses --teacher / --distill_* combinations that cannot work, before anything is built.
void check_distill_flags(bool evaluating);

}  // namespace dtrain::examples
