// Serialized TensorBoard Event messages (engine/proto/tensorboard.proto). Private to the
// engine: this header keeps the generated protobuf code out of every other translation unit
// (libtorch ships protobuf headers of another version, so only event_proto.cc, compiled
// without libtorch's include paths, sees the generated header).
#pragma once

#include <cstdint>
#include <string>

namespace dtrain::engine::tb_detail {

// Event{wall_time, file_version}: the first record of every events file.
std::string file_version_event(double wall_time, const std::string& version);
// Event{wall_time, step, session_log{START, msg}}.
std::string session_start_event(double wall_time, int64_t step, const std::string& msg);
// Event{wall_time, step, summary{value{tag, simple_value}}}.
std::string scalar_event(double wall_time, int64_t step, const std::string& tag, float value);
// Event{wall_time, step, summary{value{tag, metadata{plugin "text"}, tensor: DT_STRING [1]}}}.
std::string text_event(double wall_time, int64_t step, const std::string& tag,
                       const std::string& text);

}  // namespace dtrain::engine::tb_detail
