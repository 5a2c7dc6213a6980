// Heavy, stable headers shared by every dtrain target through one precompiled header.
// Sources still include what they use; this only makes parsing fast.
#pragma once
#include <ATen/ATen.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/nn.h>
#include <torch/optim.h>
#include <torch/serialize.h>
#include <c10/util/Exception.h>
#include <glog/logging.h>
#include <nlohmann/json.hpp>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>
