// The ATen-level precompiled header: for the libraries whose sources use tensors but no
// torch::nn, optim or autograd API (dtrain_use_pch(target ATEN) in CMakeLists.txt). Sources
// still include what they use; this only makes parsing fast.
#pragma once
#include <ATen/ATen.h>
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
