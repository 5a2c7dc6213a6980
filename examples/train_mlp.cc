// train_mlp: a feed-forward classifier. By default it learns scikit-learn's 8x8 handwritten
// digits (64 pixels, 10 classes); --data=synthetic uses a random linear-teacher task.
//   train_mlp --steps=200 --batch_size=64
//   dtrain-run -np 2 -- train_mlp --batch_size=32          (same global batches as above)
#include "common.h"
#include "distill.h"
#include "model_factory.h"

using namespace dtrain;

int main(int argc, char** argv) {
  return examples::guarded_main("train_mlp", [&] {
    examples::Run run = examples::init_run(argc, argv, "train_mlp [flags]: MLP classifier",
                                           examples::model_flag_defaults("mlp"), nullptr,
                                           examples::model_flag_names("mlp"));
    examples::ClassificationData data = examples::classification_data();
    examples::ExampleModel model = examples::build_example_model("mlp", run);
    examples::attach_teacher(run, model);  // --teacher: distillation
    engine::TrainerOptions options = examples::trainer_options(run, model.default_optimizer);
    options.eval_loss_and_correct = model.eval_loss_and_correct;  // eval_accuracy
    examples::plan_and_apply(run, model, options);
    engine::Trainer trainer(*model.module, model.loss, *run.mesh, run.device, options);
    engine::DataLoader train_loader(data.train, examples::loader_options(run, engine::cli::flags().batch_size, true, engine::cli::flags().seed));
    auto eval_loader = examples::eval_loader(run, data);
    examples::fit_and_report(run, trainer, *model.module, train_loader, eval_loader.get());
    return 0;
  });
}
