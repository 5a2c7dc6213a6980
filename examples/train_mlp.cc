// train_mlp: a feed-forward classifier. By default it learns scikit-learn's 8x8 handwritten
// digits (64 pixels, 10 classes); --data=synthetic uses a random linear-teacher task.
//   train_mlp --steps=200 --batch_size=64
//   dtrain-run -np 2 -- train_mlp --batch_size=32          (same global batches as above)
#include "common.h"

int main(int argc, char** argv) {
  return dtrain::examples::train_digits_classifier(argc, argv, "train_mlp", "mlp",
                                                   "train_mlp [flags]: MLP classifier");
}
