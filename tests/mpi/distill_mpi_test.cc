// Vocabulary-parallel distillation against distillation_loss on the gathered logits, for
// T = 2 and 4 (as the world allows): vocabularies that divide, that do not (padding holding
// garbage), and so small that a shard is all padding; several temperatures and alphas. The
// loss on every rank, and each rank's gradient slice against the same slice of the full
// gradient (zero on padding), to 1e-5 in float32 and 1e-12 in float64.
#include <gtest/gtest.h>

#include <cmath>
#include <sstream>
#include <string>

#include <torch/torch.h>

#include "dtrain/dist/error.h"
#include "dtrain/dist/mesh.h"
#include "dtrain/engine/parallel/distill.h"
#include "dtrain/engine/parallel/tensor_parallel.h"
#include "test_util.h"

namespace dtrain::engine {
namespace {

using testing_util::rel_error;
using testing_util::same_everywhere;
using testing_util::world_comm;

// Compares the split loss with the unsplit one for one vocabulary size and dtype.
void check_vocab_parallel_distill(dist::Communicator& tp, int64_t V, at::ScalarType dtype,
                                  at::ScalarType teacher_dtype, double tol) {
  const int T = tp.size();
  const int64_t N = 7;
  const int64_t padded = (V + T - 1) / T * T, local = padded / T, start = local * tp.rank();
  // The same logits on every rank; the teacher sharper than the student, so the KL is not small.
  at::Tensor student = (same_everywhere({N, V}, 41) * 2).to(dtype);
  at::Tensor teacher = (same_everywhere({N, V}, 42) * 3).to(teacher_dtype);
  at::Tensor targets = at::remainder(at::arange(N, at::kLong) * 3 + 1, V);
  ShardSpec spec{1, 1, V, padded};
  for (double temperature : {1.0, 2.0, 4.0}) {
    for (double alpha : {0.0, 0.5, 1.0}) {
      const DistillOptions o{temperature, alpha};
      std::ostringstream where;
      where << "T=" << T << " V=" << V << " dtype " << dtype << " teacher " << teacher_dtype
            << " temperature " << temperature << " alpha " << alpha;
      at::Tensor mine = shard_of(student, spec, tp.rank(), T).clone();
      at::Tensor mine_teacher = shard_of(teacher, spec, tp.rank(), T).clone();
      // Padding columns hold garbage (large, so that counting them would show): ignored.
      for (int64_t c = 0; c < local; ++c) {
        if (start + c >= V) {
          mine.select(1, c).fill_(50.0);
          mine_teacher.select(1, c).fill_(60.0);
        }
      }
      mine.requires_grad_(true);
      mine_teacher.requires_grad_(true);  // must get no gradient
      at::Tensor loss = vocab_parallel_distillation_loss(mine, mine_teacher, targets, start, V, tp, o);
      at::Tensor full = student.clone().requires_grad_(true);
      at::Tensor ref = distillation_loss(full, teacher, targets, o);
      ASSERT_TRUE(std::isfinite(loss.item<double>())) << where.str();
      EXPECT_EQ(loss.scalar_type(), ref.scalar_type()) << where.str();
      EXPECT_LT(rel_error(loss, ref), tol) << where.str() << ": " << loss.item<double>() << " vs "
                                           << ref.item<double>();
      loss.backward();
      ref.backward();
      ASSERT_TRUE(mine.grad().defined()) << where.str();
      EXPECT_EQ(mine.grad().scalar_type(), dtype) << where.str();
      // shard_of pads the full gradient with zero columns: padding must get exactly 0.
      at::Tensor want = shard_of(full.grad(), spec, tp.rank(), T);
      EXPECT_LT(rel_error(mine.grad(), want), tol) << where.str();
      for (int64_t c = 0; c < local; ++c) {
        if (start + c >= V) {
          EXPECT_EQ(mine.grad().select(1, c).abs().max().item<double>(), 0.0)
              << where.str() << ": padding column " << c;
        }
      }
      EXPECT_FALSE(mine_teacher.grad().defined()) << where.str() << ": the teacher is a constant";
    }
  }
}

TEST(VocabParallelDistill, MatchesTheLossOnTheGatheredLogits) {
  if (world_comm().size() < 2) GTEST_SKIP() << "needs 2 ranks";
  for (int T : testing_util::tp_group_sizes()) {
    dist::Mesh mesh(world_comm(), T);
    // A vocabulary that divides, one that does not, one with one padding column on the last
    // rank, and one of a single word (every rank but the first holds only padding).
    for (int64_t V : {int64_t{4} * T, int64_t{5} * T - 1, int64_t{T} + 1, int64_t{1}}) {
      check_vocab_parallel_distill(mesh.tp(), V, at::kFloat, at::kFloat, 1e-5);
      check_vocab_parallel_distill(mesh.tp(), V, at::kDouble, at::kDouble, 1e-12);
    }
    // A bf16 teacher (a half-precision model): computed in float32 on both sides.
    check_vocab_parallel_distill(mesh.tp(), 5 * T - 1, at::kFloat, at::kBFloat16, 1e-5);
  }
}

TEST(VocabParallelDistill, TeacherOfAnotherVocabularyIsRefused) {
  if (world_comm().size() < 2) GTEST_SKIP() << "needs 2 ranks";
  for (int T : testing_util::tp_group_sizes()) {
    dist::Mesh mesh(world_comm(), T);
    // Refused on every rank before any collective (the shapes are local), so nothing hangs.
    at::Tensor student = at::randn({3, 4}), teacher = at::randn({3, 6});
    at::Tensor targets = at::zeros({3}, at::kLong);
    std::string msg = testing_util::error_of([&] {
      vocab_parallel_distillation_loss(student, teacher, targets, 4 * mesh.tp_rank(), 4 * T, mesh.tp(), {});
    });
    EXPECT_NE(msg.find("the teacher's logits have V=6, the student's V=4"), std::string::npos) << msg;
    EXPECT_NE(msg.find("must share the student's vocabulary"), std::string::npos) << msg;
    msg = testing_util::error_of([&] {
      vocab_parallel_distillation_loss(student, student, targets, 0, 4 * T, mesh.tp(), {2.0, 1.5});
    });
    EXPECT_NE(msg.find("--distill_alpha=1.5"), std::string::npos) << msg;
  }
}

}  // namespace
}  // namespace dtrain::engine
