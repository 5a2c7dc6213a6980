// train_cnn: a small convolutional network on 8x8 images (scikit-learn's digits by default,
// --data=synthetic for random images with a linear-teacher label).
#include "common.h"
#include "distill.h"
#include "model_factory.h"

using namespace dtrain;

int main(int argc, char** argv) {
  return examples::guarded_main("train_cnn", [&] {
    examples::Run run = examples::init_run(argc, argv, "train_cnn [flags]: CNN on 8x8 images",
                                           examples::model_flag_defaults("cnn"), nullptr,
                                           examples::model_flag_names("cnn"));
    examples::ClassificationData data = examples::classification_data();
    examples::ExampleModel model = examples::build_example_model("cnn", run);
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
