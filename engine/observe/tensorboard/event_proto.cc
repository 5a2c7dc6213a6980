#include "event_proto.h"

#include "observe/proto/tensorboard.pb.h"

namespace dtrain::engine::tb_detail {
namespace {

constexpr int kDtString = 7;  // TensorBoard's types.proto DT_STRING

std::string serialize(const dtrain::tb::Event& event) {
  std::string out;
  event.SerializeToString(&out);
  return out;
}

}  // namespace

std::string file_version_event(double wall_time, const std::string& version) {
  dtrain::tb::Event event;
  event.set_wall_time(wall_time);
  event.set_file_version(version);
  return serialize(event);
}

std::string session_start_event(double wall_time, int64_t step, const std::string& msg) {
  dtrain::tb::Event event;
  event.set_wall_time(wall_time);
  event.set_step(step);
  auto* log = event.mutable_session_log();
  log->set_status(dtrain::tb::SessionLog::START);
  log->set_msg(msg);
  return serialize(event);
}

std::string scalar_event(double wall_time, int64_t step, const std::string& tag, float value) {
  dtrain::tb::Event event;
  event.set_wall_time(wall_time);
  event.set_step(step);
  auto* v = event.mutable_summary()->add_value();
  v->set_tag(tag);
  v->set_simple_value(value);
  return serialize(event);
}

std::string text_event(double wall_time, int64_t step, const std::string& tag,
                       const std::string& text) {
  dtrain::tb::Event event;
  event.set_wall_time(wall_time);
  event.set_step(step);
  auto* v = event.mutable_summary()->add_value();
  v->set_tag(tag);
  v->mutable_metadata()->mutable_plugin_data()->set_plugin_name("text");
  auto* tensor = v->mutable_tensor();
  tensor->set_dtype(kDtString);
  tensor->mutable_tensor_shape()->add_dim()->set_size(1);
  tensor->add_string_val(text);
  return serialize(event);
}

}  // namespace dtrain::engine::tb_detail
