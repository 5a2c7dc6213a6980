// train_cnn: a small convolutional network on 8x8 images (scikit-learn's digits by default,
// --data=synthetic for random images with a linear-teacher label).
#include "common.h"

int main(int argc, char** argv) {
  return dtrain::examples::train_digits_classifier(argc, argv, "train_cnn", "cnn",
                                                   "train_cnn [flags]: CNN on 8x8 images");
}
